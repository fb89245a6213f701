"""bench throughput on real Gloo groups of 1 and 2 processes: every variant asked is timed, with
sane statistics and the ratios the table prints."""
import json

import pytest

from shmlearn.bench.throughput import ThroughputConfig, _variants
from shmlearn.cli import main


def test_variants_per_worker_count():
    c = ThroughputConfig(strategies=["allreduce", "ps", "weight-avg", "allreduce:eager"],
                         baselines=["plain", "plain-fp32", "ddp", "local"])
    # one worker: no ddp/local baselines, and every strategy is the same step (allreduce stands for all)
    assert _variants(c, 1) == ["plain", "plain-fp32", "allreduce", "allreduce:eager"]
    assert _variants(c, 2) == ["plain", "plain-fp32", "ddp", "local", "allreduce", "ps", "weight-avg",
                               "allreduce:eager"]


def test_bench_throughput_cpu_one_and_two_processes(tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--device", "cpu", "--model", "mlp", "--input", "1x8x8", "--workers", "1,2",
               "--batch-sizes", "16", "--strategies", "allreduce,ps,weight-avg", "--baselines", "plain,ddp,local",
               "--avg-period", "2", "--repeats", "5", "--seconds", "0.02", "--warmup-steps", "2", "--samples", "512",
               "--threads", "1", "--sync-models", "mlp", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    for key in ("device", "driver", "torch_version", "date", "cpu_count"):
        assert key in doc["env"]
    got = {(r["workers"], r["variant"]) for r in doc["results"]}
    assert got == {(1, "plain"), (1, "allreduce"), (2, "plain"), (2, "ddp"), (2, "local"), (2, "allreduce"),
                   (2, "ps"), (2, "weight-avg")}
    for r in doc["results"]:
        assert "error" not in r, r
        s = r["steps_per_s"]
        assert s["n"] == 5 and 0 < s["min"] <= s["median"] <= s["max"]
        assert r["samples_per_s"]["median"] == pytest.approx(s["median"] * r["batch"] * r["workers"], rel=1e-6)
        # CPU: no graphs; shmlearn's SGD strategies take the fast step (loss read every 10 steps)
        expected = "fast-eager" if r["variant"] in ("allreduce", "ps", "weight-avg", "local") else ("eager", "classic")
        assert r["mode"] in (expected if isinstance(expected, tuple) else (expected,)), (r["variant"], r["mode"])
    w2 = {r["variant"]: r for r in doc["results"] if r["workers"] == 2}
    assert w2["allreduce"]["vs_plain"] > 0 and w2["allreduce"]["vs_ddp"] > 0 and w2["allreduce"]["scaling"] > 0
    (sync,) = doc["sync"]
    from shmlearn.sync.allreduce import AllReduce  # the flat buffer carries its control slots (loss, noise scale)
    assert sync["sync_model"] == "mlp" and sync["bytes"] == 4 * (sync["params"] + AllReduce.control_slots)
    assert sync["ratio"] > 0
    assert "vs plain" in capsys.readouterr().out


@pytest.mark.parametrize("args,needle", [(["--strategies", "gossip"], "--strategies gossip"),
                                         (["--repeats", "3"], "--repeats 3"),
                                         (["--baselines", "keras"], "--baselines keras"),
                                         (["--device", "cuda", "--workers", "64"], "--workers 64"),
                                         (["--input", "3x32"], "--input 3x32")])
def test_bad_input_exits_2(tmp_path, capsys, args, needle):
    assert main(["bench", "throughput", *args, "--out", str(tmp_path / "x.json")]) == 2
    assert needle in capsys.readouterr().err


def test_check_every_help_gives_the_real_defaults():
    import argparse
    from shmlearn.bench.throughput import register
    from shmlearn.fast import DEFAULT_CHECK_EVERY
    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    help_ = next(a.help for a in sub.choices["throughput"]._actions if a.dest == "check_every")
    assert f"[{DEFAULT_CHECK_EVERY['cpu']} on CPU, {DEFAULT_CHECK_EVERY['cuda']} on CUDA]" in help_  # said 1 on CPU
