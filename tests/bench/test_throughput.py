"""bench throughput on real Gloo groups of 1 and 2 processes: every variant asked is timed, with
sane statistics and the ratios the table prints."""
import json

import pytest

from shmlearn.bench.throughput import ThroughputConfig, _ratios, _variants, steps_per_repeat
from shmlearn.cli.main import main


def test_variants_per_worker_count():
    c = ThroughputConfig(strategies=["allreduce", "ps", "weight-avg", "allreduce:eager"],
                         baselines=["plain", "plain-fp32", "ddp", "local"])
    # one worker: no ddp/local baselines, and every strategy is the same step (allreduce stands for all)
    assert _variants(c, 1) == ["plain", "plain-fp32", "allreduce", "allreduce:eager"]
    assert _variants(c, 2) == ["plain", "plain-fp32", "ddp", "local", "allreduce", "ps", "weight-avg",
                               "allreduce:eager"]
    # the graph and compile baselines run at every worker count (each rank alone when W > 1)
    c = ThroughputConfig(strategies=["allreduce", "allreduce:compile", "ps:eager+compile-max"],
                         baselines=["plain", "graph", "compile", "compile-max", "ddp"])
    assert _variants(c, 1) == ["plain", "graph", "compile", "compile-max", "allreduce", "allreduce:compile"]
    assert _variants(c, 2) == ["plain", "graph", "compile", "compile-max", "ddp", "allreduce", "allreduce:compile",
                               "ps:eager+compile-max"]


def test_steps_per_repeat_holds_whole_sampling_periods_when_cheap():
    # no periodic eager step: about `seconds` of steps, 5 to 5000
    assert steps_per_repeat(0.2, 0.22e-3) == 910
    assert steps_per_repeat(0.2, 1.0) == 5 and steps_per_repeat(100.0, 1e-6) == 5000
    # alexnet-small at 0.22 ms with one eager step in 256: four whole periods (0.23 s), so each
    # repeat pays the same share of eager steps (76-236 steps let them fall in some repeats only)
    assert steps_per_repeat(0.2, 0.22e-3, 256) == 1024
    # resnet34 at 3.8 ms: one period (0.97 s) is within 10x 0.2 s
    assert steps_per_repeat(0.2, 3.8e-3, 256) == 256
    # resnet34 at batch 1024, 21 ms: a period would be 5.4 s, 27x; left as timed
    assert steps_per_repeat(0.2, 21e-3, 256) == 10


def test_ratio_to_best_baseline_is_against_the_best_of_plain_graph_compile():
    def row(w, v, sps):
        return {"workers": w, "batch": 16, "variant": v, "samples_per_s": {"median": sps}}
    rows = [row(1, "plain", 100.0), {"workers": 1, "batch": 16, "variant": "graph", "skipped": "CUDA only"},
            row(1, "compile", 150.0), row(1, "compile-max", 120.0), row(1, "plain-fp32", 400.0),
            row(1, "allreduce", 300.0), row(1, "allreduce:compile", 75.0),
            row(2, "plain", 90.0), row(2, "ddp", 500.0), row(2, "local", 180.0), row(2, "allreduce", 45.0)]
    _ratios(rows)
    by = {(r["workers"], r["variant"]): r for r in rows}
    # plain-fp32 and ddp are not what ratio_to_best_baseline compares with; baselines get none
    assert by[1, "allreduce"]["ratio_to_best_baseline"] == 2.0 and by[1, "allreduce"]["best_baseline"] == "compile"
    assert by[1, "allreduce:compile"]["ratio_to_best_baseline"] == 0.5
    assert by[2, "local"]["ratio_to_best_baseline"] == 2.0 and by[2, "allreduce"]["best_baseline"] == "plain"
    assert not any("ratio_to_best_baseline" in by[k] for k in [(1, "plain"), (1, "compile"), (2, "ddp")])


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


def test_graph_and_compile_baselines_and_compiled_step_on_cpu(tmp_path, capsys):
    """On the CPU: graph is a skipped row, compile and compile-max run torch.compile mode default and
    say so, shmlearn's :compile step runs compiled; ratio_to_best_baseline is what the rows give."""
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--device", "cpu", "--model", "mlp", "--input", "1x8x8", "--workers", "1",
               "--batch-sizes", "16", "--strategies", "allreduce,allreduce:compile",
               "--baselines", "plain,graph,compile,compile-max", "--repeats", "5", "--seconds", "0.02",
               "--warmup-steps", "2", "--samples", "512", "--threads", "1", "--out", str(out)])
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["plain", "graph", "compile", "compile-max", "allreduce", "allreduce:compile"]
    assert "CUDA only" in rows["graph"]["skipped"] and "samples_per_s" not in rows["graph"]
    if "error" in rows["compile"]:  # only where Inductor cannot build its C++ (tests/inductor.py): both rows say
        # so, and shmlearn's :compile step runs eagerly, saying why
        for v in ("compile", "compile-max"):
            assert rows[v]["error"] == ("BackendCompilerFailed: backend='inductor' raised: "
                                        "CppCompileError: C++ compile error"), rows[v]
        r = rows["allreduce:compile"]
        assert r["compile"] == "off" and r["compile_s"] is None
        assert r["note"] == ("--compile default: Inductor could not build the step's code on this machine "
                             "(CppCompileError: C++ compile error); the step runs eagerly"), r
    else:
        for v in ("compile", "compile-max"):
            r = rows[v]
            assert r["mode"] == "compiled" and r["compile_mode"] == "default" and "mode default" in r["note"], r
        assert rows["compile"]["setup_s"] > 0.5  # Inductor compiled forward and backward before the clock
        assert rows["allreduce:compile"]["compile"] == "default" and rows["allreduce:compile"]["compile_s"] >= 0
    assert "compile" not in rows["allreduce"]
    best = max((v for v in ("plain", "compile", "compile-max") if "samples_per_s" in rows[v]),
               key=lambda v: rows[v]["samples_per_s"]["median"])
    for v in ("allreduce", "allreduce:compile"):
        r = rows[v]
        assert "error" not in r, r
        assert r["steps_per_s"]["n"] == 5 and r["best_baseline"] == best
        assert r["ratio_to_best_baseline"] == pytest.approx(
            r["samples_per_s"]["median"] / rows[best]["samples_per_s"]["median"], rel=1e-12)
    text = capsys.readouterr().out
    assert "vs best" in text and "graph" in text and "skipped: CUDA only" in text


@pytest.mark.parametrize("args,needle", [(["--strategies", "gossip"], "--strategies gossip"),
                                         (["--repeats", "3"], "--repeats 3"),
                                         (["--baselines", "keras"], "--baselines keras"),
                                         (["--baselines", "plain,graphs"], "--baselines graphs"),
                                         (["--strategies", "allreduce:jit"], "--strategies allreduce:jit"),
                                         (["--strategies", "allreduce:compile+compile-max"],
                                          "--strategies allreduce:compile+compile-max"),
                                         (["--device", "cuda", "--workers", "64"], "--workers 64"),
                                         (["--input", "3x32"], "--input 3x32")])
def test_bad_input_exits_2(tmp_path, capsys, args, needle):
    assert main(["bench", "throughput", *args, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err  # one line, no traceback


def test_check_every_help_gives_the_real_defaults():
    import argparse
    from shmlearn.bench.parsers import throughput
    from shmlearn.step.fast import DEFAULT_CHECK_EVERY
    sub = argparse.ArgumentParser().add_subparsers()
    throughput(sub)
    help_ = next(a.help for a in sub.choices["throughput"]._actions if a.dest == "check_every")
    assert f"[{DEFAULT_CHECK_EVERY['cpu']} on CPU, {DEFAULT_CHECK_EVERY['cuda']} on CUDA]" in help_  # said 1 on CPU


def test_modifiers_set_their_fields_and_inductor_options_add_up():
    from shmlearn.bench.throughput import ThroughputConfig, step_options
    c = ThroughputConfig(precision="bf16", channels_last=True)
    opts, tuning = step_options(c, {"compile", "combo", "aggressive", "cdt", "joined-conv", "2-streams"})
    assert (opts.compile, tuning.defer_wgrad, tuning.side_streams, opts.combo_kernels) == ("default", False, 2, "on")
    assert dict(tuning.inductor) == {"coordinate_descent_tuning": True, "aggressive_fusion": True}
    assert (opts.precision, opts.channels_last) == ("bf16", True)
    plain, plain_tuning = step_options(c, set())
    assert (plain_tuning.inductor, plain_tuning.defer_wgrad, plain_tuning.side_streams, plain.compile) == ((), True, 1, "off")
    assert plain.combo_kernels == "auto"


def test_vs_best_ddp_is_against_the_better_of_ddp_and_ddp_compile():
    def row(w, v, sps):
        return {"workers": w, "batch": 16, "variant": v, "samples_per_s": {"median": sps}}
    rows = [row(1, "allreduce", 100.0), row(2, "ddp", 100.0), row(2, "ddp-compile", 160.0), row(2, "allreduce", 200.0)]
    _ratios(rows)
    by = {(r["workers"], r["variant"]): r for r in rows}
    assert by[2, "allreduce"]["vs_best_ddp"] == 1.25 and by[2, "allreduce"]["vs_ddp"] == 2.0
    assert by[2, "ddp-compile"]["scaling"] == 1.6  # against the default strategy at one worker, as ddp
    assert "vs_best_ddp" not in by[2, "ddp"] and "vs_best_ddp" not in by[1, "allreduce"]


def test_ddp_compile_runs_at_two_gloo_processes(tmp_path):
    """The DDP model under torch.compile (Dynamo's DDPOptimizer splits it at the buckets) trains
    at W=2 on the CPU; at W=1 there is no such row."""
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--device", "cpu", "--model", "mlp", "--input", "1x8x8", "--workers", "1,2",
               "--batch-sizes", "16", "--strategies", "allreduce", "--baselines", "ddp-compile",
               "--repeats", "5", "--seconds", "0.02", "--warmup-steps", "2", "--samples", "512", "--threads", "1",
               "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    got = {(r["workers"], r["variant"]): r for r in doc["results"]}
    assert set(got) == {(1, "allreduce"), (2, "ddp-compile"), (2, "allreduce")}
    assert "error" not in got[2, "ddp-compile"] and got[2, "ddp-compile"]["mode"] == "compiled"
    assert got[2, "allreduce"]["vs_best_ddp"] > 0
