"""benchmarks/step_agreement.py: variants of the fast step that must train to the same weights do,
and a variant that does not is reported (exit 1, equal_bits false)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import step_agreement  # noqa: E402


def test_the_overlap_variants_train_to_the_same_bits_on_the_cpu(tmp_path):
    out = tmp_path / "agree.json"
    rc = step_agreement.main(["--device", "cpu", "--model", "mlp", "--input-shape", "1x8x8", "--batch", "16",
                              "--steps", "12", "--variants", "allreduce:serial-conv,allreduce:joined-conv,allreduce",
                              "--out", str(out)])
    d = json.loads(out.read_text())
    assert rc == 0
    assert [r["variant"] for r in d["rows"]] == ["allreduce:serial-conv", "allreduce:joined-conv", "allreduce"]
    assert all(r["equal_bits"] and r["losses_equal"] and r["max_abs_diff"] == 0 for r in d["rows"])
    assert len(d["rows"][0]["losses"]) == 12 and d["cudnn_deterministic"]


def test_a_variant_that_trains_elsewhere_is_reported(tmp_path, monkeypatch):
    real = step_agreement.train

    def train(c, variant, device, batch, steps):
        w, losses, row = real(c, variant, device, batch, steps)
        return (w + 1e-3 if variant == "allreduce" else w), losses, row
    monkeypatch.setattr(step_agreement, "train", train)
    out = tmp_path / "agree.json"
    rc = step_agreement.main(["--device", "cpu", "--model", "mlp", "--input-shape", "1x8x8", "--batch", "16",
                              "--steps", "3", "--variants", "allreduce:serial-conv,allreduce", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 1
    assert rows[0]["equal_bits"] and not rows[1]["equal_bits"]
    assert abs(rows[1]["max_abs_diff"] - 1e-3) < 1e-6


def test_it_leaves_cudnns_determinism_as_it_found_it(tmp_path):
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = False
    try:
        step_agreement.main(["--device", "cpu", "--model", "mlp", "--input-shape", "1x8x8", "--batch", "16",
                             "--steps", "2", "--variants", "allreduce", "--out", str(tmp_path / "a.json")])
        assert not torch.backends.cudnn.deterministic
    finally:
        torch.backends.cudnn.deterministic = before
