"""`shmlearn advise` against a sweep built to follow McCandlish et al.'s model exactly: the steps to
the target are S_min (1 + B_crit / B), every run measured B_simple = B_crit, and the step time is
a line in the per-worker batch; advise must give back B_crit, S_min, the measured steps, the
winners and the least-time configuration computed here by hand."""
import json
import math
import os

import pytest

from shmlearn.analysis.advise import advise, fit_b_crit
from shmlearn.cli.main import main

S_MIN, B_CRIT = 100, 64
LINES = {1: (0.001, 0.0001), 2: (0.003, 0.0001)}  # step seconds = a + c * per-worker batch
GRID = [(1, 16), (1, 32), (1, 64), (1, 128), (1, 256), (2, 16), (2, 32), (2, 64), (2, 128)]


def steps_to(g):
    return S_MIN * (1 + B_CRIT / g)


def _write_run(d, w, b, lr, hit_step, total, step_s, b_simple=B_CRIT):
    os.makedirs(d, exist_ok=True)
    rows = []
    for step in range(5, total + 1, 5):  # loss 1.0 until the target step, then 0.01: the trailing
        loss = 1.0 if step < hit_step else 0.01  # mean of 5 rows first drops under 0.9 at hit_step
        rows.append({"step": step, "samples": step * w * b, "time_s": step * step_s, "loss": loss,
                     "phase_s": {}, "noise_scale": {"b_simple": b_simple, "g2": 1.0, "trace": b_simple}})
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump({"status": "completed", "strategy": "allreduce", "workers": w, "batch_size": b, "lr": lr,
                   "wall_time_s": total * step_s, "steps": total, "phase_s": {"update": 1e-4},
                   "model": "mlp", "dataset": "digits", "device": "cpu"}, f)


@pytest.fixture
def sweep(tmp_path):
    ids = []
    for w, b in GRID:
        g = w * b
        a, c = LINES[w]
        for lr, slower in ((0.1, 1.0), (0.3, 1.4)):  # the worse lr takes 40% more steps: advise keeps the best
            i = f"w{w}-b{b}-lr{lr}"
            ids.append(i)
            hit = round(steps_to(g) * slower / 5) * 5
            _write_run(tmp_path / "trials" / i, w, b, lr, hit, 2 * hit, a + c * b)
    (tmp_path / "sweep.json").write_text(json.dumps({"trials": ids, "slots": 2}))
    return tmp_path


def test_sweep_gives_back_the_model_it_follows(sweep):
    doc = advise(str(sweep), target_loss=0.9, workers=(1, 2))
    assert doc["b_simple"] == B_CRIT
    assert doc["s_min"] == pytest.approx(S_MIN, rel=0.01)  # steps rounded to the 5-step rows
    assert doc["b_crit_fit"] == pytest.approx(B_CRIT, rel=0.05)
    assert len(doc["measured"]) == len(GRID) and {m["lr"] for m in doc["measured"]} == {0.1}
    for m in doc["measured"]:
        assert m["steps"] == round(steps_to(m["global"]) / 5) * 5
        assert m["predicted_steps"] == pytest.approx(m["steps"], rel=0.02)
        a, c = LINES[m["workers"]]
        assert m["predicted_time_s"] == pytest.approx(m["predicted_steps"] * (a + c * m["batch"]), rel=1e-6)
    assert doc["steps_error"]["max"] < 0.02
    for w, v in doc["winners"].items():
        assert v["measured_batch"] == v["predicted_batch"]
    # the least predicted time over the grid advise searched, by hand
    best = min(((w, g) for w in (1, 2) for g in [2 ** k for k in range(2, 15)] if g % w == 0 and g // w >= (2 if w == 1 else 1)),
               key=lambda p: doc["s_min"] * (1 + B_CRIT / p[1]) * (LINES[p[0]][0] + LINES[p[0]][1] * p[1] / p[0]))
    r = doc["recommendation"]
    assert (r["workers"], r["global"]) == best


def test_free_fit_recovers_b_crit_from_exact_points():
    pts = [(g, steps_to(g)) for g in (8, 32, 128, 512, 2048)]
    assert fit_b_crit(pts) == pytest.approx(B_CRIT, rel=0.01)
    assert fit_b_crit([(32, 300.0), (32, 310.0)]) is None


def test_cli_writes_json_and_figure(sweep, capsys):
    out = sweep / "adv"
    assert main(["advise", str(sweep), "--target-loss", "0.9", "--workers", "1,2", "--out", str(out)]) == 0
    assert (out / "advise.png").stat().st_size > 10_000
    doc = json.loads((out / "advise.json").read_text())
    assert doc["kind"] == "sweep" and doc["b_simple"] == B_CRIT
    printed = capsys.readouterr().out
    assert "recommendation:" in printed and "B_simple at the target 64.0" in printed
    # Issue 38, 12: where the target comes from, and a recommendation the table never measured is said to be one.
    assert "target loss 0.9 (--target-loss)" in printed
    r = doc["recommendation"]
    listed = {(m["workers"], m["batch"]) for m in doc["measured"]}
    assert r["measured"] == ((r["workers"], r["batch"]) in listed)
    assert ("no run above measured this setup" in printed) == (not r["measured"])


def test_a_run_is_advised_from_its_own_final_loss(tmp_path):
    _write_run(tmp_path / "run", 2, 32, 0.1, 300, 400, 0.004, b_simple=50.0)
    doc = advise(str(tmp_path / "run"), workers=(1, 2, 4), comm=None)
    assert doc["kind"] == "run" and doc["target_loss"] == pytest.approx(0.01)
    assert doc["target_from"].startswith("the run's final training loss, smoothed")
    # the final loss's trailing 5-row mean is first reached when all 5 rows are past step 300
    assert doc["measured"][0]["steps"] == 320 and doc["b_simple"] == 50.0
    assert doc["s_min"] == pytest.approx(320 / (1 + 50 / 64))
    assert {p["workers"] for p in doc["predictions"] if p["time_s"] is not None} == {1, 2, 4}
    assert doc["b_crit_fit"] is None


@pytest.mark.parametrize("argv, says", [
    (["results/sweep-digits"], "no completed run with noise-scale rows"),
    (["/nonexistent-dir"], "neither a run directory"),
    (["results/noise-scale/sweep-digits", "--target-loss", "-1"], "--target-loss -1.0: must be"),
    (["results/noise-scale/sweep-digits", "--target-loss", "1e-9"], "--target-loss 1e-09: no run reaches it"),
])
def test_bad_input_is_one_line(capsys, argv, says, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = [os.path.join(root, a) if a.startswith("results/") else a for a in argv]
    assert main(["advise", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_committed_sweeps_advice_is_what_the_notes_say():
    """The committed advise.json files (acceptance 2) are what advise computes from the committed sweeps."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in ("digits", "fashion"):
        base = os.path.join(root, "results", "noise-scale")
        saved = json.load(open(os.path.join(base, f"advise-{name}", "advise.json")))
        doc = advise(os.path.join(base, f"sweep-{name}"))
        assert doc["b_simple"] == pytest.approx(saved["b_simple"]) and doc["b_crit_fit"] == pytest.approx(saved["b_crit_fit"])
        assert [m["steps"] for m in doc["measured"]] == [m["steps"] for m in saved["measured"]]
        assert math.isfinite(doc["steps_error"]["median"])


# --- a run directory as the user left it (issue 53's fault campaign) ------------------------------

@pytest.fixture
def run(tmp_path):
    _write_run(tmp_path / "run", 1, 32, 0.1, 300, 400, 0.004, b_simple=50.0)
    (tmp_path / "run" / "config.yaml").write_text("model: mlp\nworkers: 1\n")
    return tmp_path / "run"


def test_the_default_output_folder_a_link_out_of_the_run_is_refused(run, tmp_path, capsys):
    """RUN/advise a link to a folder elsewhere: advise.json and advise.png were written there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, run / "advise")
    assert main(["advise", str(run), "--workers", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{run / 'advise'}: a symlink to {outside}, outside {run}" in err[0], err
    assert os.listdir(outside) == []


def test_an_out_given_as_a_link_is_where_the_user_asked_the_files_to_go(run, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, tmp_path / "adv")
    assert main(["advise", str(run), "--workers", "1,2", "--out", str(tmp_path / "adv")]) == 0
    assert json.loads((outside / "advise.json").read_text())["kind"] == "run"


@pytest.mark.parametrize("argv, says", [
    (["--workers", "1,1000000000000"], "--workers 1,1000000000000: 1,000,000,000,000 is more than 1,000,000"),
    ([], "config.yaml: expected an object at the top, got a list"),
], ids=["workers-1e12", "config-a-list"])
def test_a_run_advise_cannot_read_or_a_count_past_any_machine_is_one_line(run, tmp_path, capsys, argv, says):
    if not argv:
        (run / "config.yaml").write_text("- 1\n- 2\n")  # was read around: exit 0
    assert main(["advise", str(run), *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("took, config, flag, want", [
    ("shared-memory", None, None, "comm-shm-cpu.json"),     # what the run's summary says it took
    ("gloo", None, None, "comm-gloo-cpu.json"),             # auto that fell back, or --shared-memory off
    (None, "'off'", None, "comm-gloo-cpu.json"),            # one worker (no collectives) run with off
    (None, "off", None, "comm-gloo-cpu.json"),              # a hand-written config: YAML's false
    (None, None, None, "comm-shm-cpu.json"),                # an older run: train's default now
    ("shared-memory", None, "off", "comm-gloo-cpu.json"),   # advise --shared-memory picks instead
])
def test_a_cpu_run_is_advised_with_the_measurement_of_its_collectives_path(tmp_path, capsys, took, config, flag, want):
    from shmlearn.analysis.simulate.comm import RESULTS
    if not all(os.path.exists(os.path.join(RESULTS, f)) for f in ("comm-shm-cpu.json", "comm-gloo-cpu.json")):
        pytest.skip("committed comm measurements missing")
    run = tmp_path / "run"
    _write_run(run, 2, 32, 0.1, 300, 400, 0.004, b_simple=50.0)
    s = json.loads((run / "summary.json").read_text())
    if took:
        s["collectives"] = took
        (run / "summary.json").write_text(json.dumps(s))
    if config:
        (run / "config.yaml").write_text(f"shared_memory: {config}\n")
    argv = ["advise", str(run), "--workers", "1,2,4"] + (["--shared-memory", flag] if flag else [])
    assert main(argv) == 0
    doc = json.loads((run / "advise" / "advise.json").read_text())
    assert doc["comm"] == f"results/{want}"
    assert doc["comm_after_compute"] == f"results/{want.replace('.json', '-after-compute.json')}"
    assert doc["collectives"] == ("gloo" if "gloo" in want else "shared-memory")
    assert f"communication: the repository's {doc['collectives']} measurement" in capsys.readouterr().out
