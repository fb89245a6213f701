"""bench ps-sim on real Gloo processes prints the seed's lines (seed 001, report 7) for each step."""
import json
import re

from shmlearn.bench.ps_sim import shapes_of
from shmlearn.cli.main import main

SEED_LINES = [  # the seed's sample output, in its order, numbers replaced by patterns
    r"---->Start time = \d+\.\d{6}",
    r"Gradient Fetch Time = \d+\.\d{6}",
    r"#Worker_Gradients = {w}",
    r"Gradient Avg time = \d+\.\d{6}",
    r"Global Step {k}, Learning Rate = 0\.400000",
    r"Weight Update time = \d+\.\d{6}",
    r"Local Step {k}, Loss = \d+\.\d{6}",
    r"---->End time = \d+\.\d{6}",
    r"Time spent = \d+\.\d{6}",
    r"Weight distribution time = \d+\.\d{6}",
]


def test_alexnet_small_shapes():
    assert shapes_of("alexnet-small") == [(32, 3, 5, 5), (32,), (32, 32, 5, 5), (32,), (64, 32, 5, 5), (64,),
                                          (64, 1024), (64,), (32, 64), (32,), (10, 32), (10,)]


def test_ps_sim_prints_the_seed_lines(tmp_path, capfd, spawned_workers):
    out = tmp_path / "ps.json"
    assert main(["bench", "ps-sim", "--workers", "1,2", "--steps", "2", "--warmup", "1",
                 "--out", str(out), "--no-plot"]) == 0
    lines = [l for l in capfd.readouterr().out.splitlines() if l and not l.startswith(("==", "ps-sim", "wrote"))]
    expected = [p.replace("{w}", str(w)).replace("{k}", str(k)) for w in (1, 2) for k in range(3) for p in SEED_LINES]
    assert len(lines) == len(expected)
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    doc = json.loads(out.read_text())
    assert doc["gradient_bytes"] == 4 * 147338  # alexnet-small's parameters in float32
    assert [r["workers"] for r in doc["results"]] == [1, 2] and [r["processes"] for r in doc["results"]] == [2, 3]
    for r in doc["results"]:
        assert len(r["steps"]) == 3 and r["stats"]["fetch_s"]["n"] == 2
        assert all(s["n_gradients"] == r["workers"] for s in r["steps"])
        for key in ("fetch_s", "avg_s", "update_s", "dist_s", "time_spent_s"):
            assert 0 < r["stats"][key]["median"] < 10


def test_too_few_gpus_counts_one_worker(monkeypatch):
    import pytest
    import torch
    from shmlearn.bench.ps_sim import PsSimConfig, run
    from shmlearn.errors import BadInput
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(BadInput, match="at most 1 worker on 2 GPUs"):  # said "1 workers"
        run(PsSimConfig(backend="nccl", workers=[1, 2]))
