"""Sweeps, experiments and the Python API start their CPU workers from the forkserver, as `train`
does (issue 52): a pool of a process without one starts it; a forked worker writes where its
owner's stdout and stderr go when it starts (pytest's capture, a notebook's cell); the runs give
what the spawned workers gave."""
import json
import os
import subprocess
import sys

import pytest

from shmlearn.launch import forkserver
from shmlearn.launch.pool import Pool


def say(env, text):
    print(f"{text} on stdout", flush=True)
    print(f"{text} on stderr", file=sys.stderr, flush=True)
    os.write(1, f"{text} through fd 1\n".encode())
    return os.getppid()


def test_a_forked_workers_output_goes_where_the_owners_goes_now(capfd, monkeypatch):
    """capfd puts its own files on fd 1 and 2 for this test, after the session's forkserver
    started (conftest): a fork that kept the forkserver's wrote past it."""
    monkeypatch.delenv("SHMLEARN_FORKSERVER", raising=False)  # SHMLEARN_TEST_SPAWN=1 sessions
    assert forkserver.start()  # the session's (conftest), or one for this test
    # An earlier test of the session may have left an import-time variable changed (a pool then
    # spawns, rightly: test_pool_forkserver.py); this test is about a fork's output, so the
    # variables are put back as they were when the forkserver started, for its duration.
    started, now = forkserver._started_env or {}, forkserver._import_env()
    drift = {k: (started.get(k), now.get(k)) for k in set(started) | set(now) if started.get(k) != now.get(k)}
    for k, (was, _) in drift.items():
        if was is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, was)
    assert forkserver.context(False).get_start_method() == "forkserver", drift
    with Pool(1) as pool:
        (parent,) = pool.run(say, ("worker 0",), slots=[0], backend=None)
        assert pool.startup[0]["forked"] is True
    assert parent != os.getpid()  # a fork of the forkserver, not a child of this process
    out, err = capfd.readouterr()
    assert "worker 0 on stdout" in out and "worker 0 through fd 1" in out, (out, err)
    assert "worker 0 on stderr" in err, (out, err)


def test_a_spawned_workers_output_is_captured_as_before(capfd, spawned_workers):
    with Pool(1) as pool:
        (parent,) = pool.run(say, ("spawned",), slots=[0], backend=None)
        assert pool.startup[0]["forked"] is False
    assert parent == os.getpid()
    out, err = capfd.readouterr()
    assert "spawned on stdout" in out and "spawned on stderr" in err


API = r"""
import json, os, sys
import shmlearn
from shmlearn.launch import forkserver
from shmlearn.launch.pool import Pool, using
from test_pool_start import say  # a function of `python -c`'s __main__ cannot reach a worker


started_at_import = forkserver._started_env is not None
with Pool(2) as pool, using(pool):
    parents = pool.run(say, ("a worker",), slots=[0, 1], backend=None)
    r = shmlearn.train(shmlearn.TrainConfig(workers=2, samples=640, batch_size=32, eval_points=1, device="cpu",
                                            threads=1, progress=False, out=sys.argv[1]))
    forked = [s["forked"] for s in pool.startup]
print(json.dumps({"at_import": started_at_import, "parents": parents, "me": os.getpid(), "forked": forked,
                  "loss": r.summary["final_loss"], "acc": r.summary["test_accuracy"]}), flush=True)
"""


def _api(tmp_path, name, **env):
    """The Python API from `python -c` (no forkserver at import: forkserver.autostart)."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "RANK", "WORLD_SIZE",
                                                             "SHMLEARN_FORKSERVER")}
    r = subprocess.run([sys.executable, "-c", API, str(tmp_path / name)], capture_output=True, text=True,
                       timeout=600, env=dict(base, PYTHONPATH=os.pathsep.join(sys.path), **env))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads(r.stdout.strip().splitlines()[-1])


def test_the_python_api_forks_its_workers_and_trains_as_spawned_ones(tmp_path):
    out, forked = _api(tmp_path, "forked")
    assert not forked["at_import"]  # `python -c`: not at import, at the first pool
    assert forked["forked"] == [True, True] and len(set(forked["parents"])) == 1
    assert forked["parents"][0] != forked["me"]
    assert out.count("a worker on stdout") == 2  # the workers' stdout is the owner's
    _, spawned = _api(tmp_path, "spawned", SHMLEARN_FORKSERVER="0")
    assert spawned["forked"] == [False, False] and spawned["parents"] == [spawned["me"]] * 2
    # the same run: one seed, the same data order, the same arithmetic (other processes, so a tolerance)
    assert forked["loss"] == pytest.approx(spawned["loss"], rel=1e-4, abs=1e-6)
    assert forked["acc"] == pytest.approx(spawned["acc"], abs=2e-3)


SWEEP = ["sweep", "--dataset", "digits", "--model", "mlp", "--workers", "1,2", "--threads", "1", "--lr", "0.1,0.3",
         "--samples", "512", "--batch-size", "32", "--eval-points", "1", "--no-report"]


def _sweep(out, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "RANK", "WORLD_SIZE",
                                                             "SHMLEARN_FORKSERVER")}
    r = subprocess.run([sys.executable, "-m", "shmlearn", *SWEEP, "--out", str(out)], capture_output=True,
                       text=True, timeout=600, env=dict(base, PYTHONPATH=os.pathsep.join(sys.path), **env))
    assert r.returncode == 0, r.stderr[-3000:]
    timing = json.loads((out / "timing.json").read_text())
    rows = {json.loads(l)["id"]: json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()}
    return timing, {k: v["summary"]["final_loss"] for k, v in rows.items()}


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd"), reason="GPU hosts' sweeps spawn")
def test_a_cli_sweeps_workers_fork_and_its_trials_equal_spawned_ones(tmp_path):
    """A CPU sweep that compiles nothing, one thread a rank: its workers fork from the sweep
    itself and never import torch._dynamo (a lean pool, trials.py); spawned ones import it."""
    timing, losses = _sweep(tmp_path / "forked")
    assert timing["startup"] and all(s["start"] == "fork" and not s["forked"] and not s["dynamo"]
                                     for s in timing["startup"]), timing["startup"]
    timing_s, losses_s = _sweep(tmp_path / "spawned", SHMLEARN_FORKSERVER="0")
    assert not any(s["forked"] for s in timing_s["startup"])
    assert all(s["start"] == "spawn" and not s["dynamo"] for s in timing_s["startup"])  # lean all the same
    assert losses.keys() == losses_s.keys() and len(losses) == 4
    for k in losses:
        assert losses[k] == pytest.approx(losses_s[k], rel=1e-4, abs=1e-6), k
