"""benchmarks/user_workloads.py's parts that need no GPU: the workloads' sizes (issue 51's ViT-tiny
and GPT LM), data that carry a signal to learn, and the timing windows read from a run's
metrics.jsonl (the harness end to end runs on a CPU with --device cpu --tiny; its GPU numbers
need a GPU)."""
import importlib.util
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def uw():
    spec = importlib.util.spec_from_file_location(
        "user_workloads", os.path.join(HERE, "..", "..", "benchmarks", "user_workloads.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["user_workloads"] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_the_workloads_are_the_issues_sizes(uw):
    vit, lm = uw.ViT(uw.SHAPES["vit"]), uw.GPT(uw.SHAPES["lm"])
    assert 5.3e6 < sum(p.numel() for p in vit.parameters()) < 5.5e6  # ViT-tiny: d 192, depth 12
    # 6 x 12 d^2 in the blocks, 8192 x 384 tied, 256 x 384 positions
    assert 13.8e6 < sum(p.numel() for p in lm.parameters()) < 14.0e6
    assert lm.lm_head.weight is lm.tok.weight
    s = uw.TINY["lm"]
    with torch.no_grad():
        assert uw.GPT(s)(torch.zeros(2, s.seq, dtype=torch.long)).shape == (2, s.seq, s.vocab)
        assert uw.ViT(uw.TINY["vit"])(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_the_data_carry_a_signal(uw):
    x, y = uw.images(2000, seed=0)
    protos = torch.stack([x[y == c].mean(0) for c in range(10)])
    guess = torch.cdist(x.flatten(1), protos.flatten(1)).argmin(1)
    assert (guess == y).float().mean() > 0.9 and x.abs().mean() > 0.1  # nearest class mean: never zeros
    s = uw.TINY["lm"]
    t = uw.tokens(64, s, seed=0)
    assert t.dtype == torch.int64 and t.shape == (64, s.seq + 1)
    e = (t[:, 1:] - 7 * t[:, :-1] - 3) % s.vocab
    assert set(e.unique().tolist()) == {0, 1, 2}


def test_steady_rates_are_each_windows_samples_over_its_seconds(uw, tmp_path):
    rows = [{"step": k, "samples": 32 * k, "time_s": 5.0 + 0.01 * k + (0.5 if k > 150 else 0.0)}
            for k in range(10, 260, 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rates = uw.steady_rates(str(tmp_path), warmup=50, steps=100, repeats=2)
    assert rates == pytest.approx([32 * 100 / 1.0, 32 * 100 / 1.5])
    with pytest.raises(RuntimeError, match="no row at step 350"):
        uw.steady_rates(str(tmp_path), warmup=50, steps=100, repeats=3)
