"""A sweep run again over a folder as the user left it (issue 53's fault campaign): a damaged
sweep.json or results.jsonl is refused in one line naming it, exit 2, with every file as it was
(a rerun used to rewrite sweep.json over the damage); a trials/ link out of the folder is refused
before anything is created through it (a rerun created trials/.tmp where the link pointed); and
the sweep's own numbers out of range are refused before any trial."""
import json
import os

import pytest

from cli_inproc import run_main

SWEEP = ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
         "--lr", "0.1,0.2", "--no-report", "--no-progress"]


def refused(args, monkeypatch, capfd):
    r = run_main(args, monkeypatch, capfd)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return lines[0]


def tree(folder):
    """Every file under folder and its bytes (the lock aside: taking it is no change)."""
    found = {}
    for d, _, names in os.walk(folder):
        for n in names:
            if n != ".lock":
                with open(os.path.join(d, n), "rb") as f:
                    found[os.path.relpath(os.path.join(d, n), folder)] = f.read()
    return found


ROW = {"id": "w1-b32-lr0.1", "status": "completed", "config": {"workers": 1, "batch_size": 32, "lr": 0.1},
       "summary": {"status": "completed", "min_loss": 0.5, "loss_area": 1.0}}


@pytest.mark.parametrize("spec,row,needle", [
    ('{"trials": ["w1', None, "sweep.json: not valid JSON"),
    ("[1, 2]", None, "sweep.json: expected an object at the top, got a list"),
    (json.dumps({"trials": [ROW["id"]]}), {**ROW, "config": {"batch_size": 32, "lr": 0.1}},
     "results.jsonl line 1 (a sweep result; fix or remove the line): 'config': 'workers' is missing"),
], ids=["spec-not-json", "spec-a-list", "row-without-workers"])
def test_a_rerun_over_a_damaged_sweep_is_refused_and_changes_nothing(tmp_path, monkeypatch, capfd, spec, row,
                                                                      needle):
    out = tmp_path / "s"
    out.mkdir()
    (out / "sweep.json").write_text(spec)
    if row is not None:
        (out / "results.jsonl").write_text(json.dumps(row) + "\n")
    before = tree(out)
    line = refused(SWEEP + ["--out", str(out)], monkeypatch, capfd)
    assert f"{out}/{needle}" in line, line
    assert tree(out) == before


@pytest.mark.parametrize("link", ["trials", "trials/.tmp"])
def test_a_trials_link_out_of_the_sweep_is_refused_before_anything_is_made_through_it(tmp_path, monkeypatch,
                                                                                       capfd, link):
    out, outside = tmp_path / "s", tmp_path / "outside"
    outside.mkdir()
    (out / "trials").mkdir(parents=True)
    os.rmdir(out / "trials")
    if link == "trials/.tmp":
        (out / "trials").mkdir()
    os.symlink(outside, out / link)
    line = refused(SWEEP + ["--out", str(out)], monkeypatch, capfd)
    assert f"{out / link}: a symlink to {outside}, outside {out}" in line, line
    assert os.listdir(outside) == []


@pytest.mark.parametrize("value,needle", [
    ("-1", "--threshold -1.0: expected a finite number >= 0"),
    ("nan", "--threshold nan: expected a finite number >= 0"),
], ids=["negative", "nan"])
def test_a_threshold_no_loss_can_meet_is_refused(tmp_path, monkeypatch, capfd, value, needle):
    """A minimum training loss at most -1: no run of a loss >= 0 survives, so no winner (it exited 0)."""
    line = refused(SWEEP + ["--threshold", value, "--out", str(tmp_path / "s")], monkeypatch, capfd)
    assert needle in line, line
    assert not (tmp_path / "s").exists()


LOCK_IN_A_FORK = """
import json, os, sys, time
from shmlearn.errors import BadInput
from shmlearn.record.runs import lock_dir
from shmlearn.sweeps.sweep_config import SweepConfig
from shmlearn.sweeps.trials import TrialRunner

class Forks(TrialRunner):
    def run_trials(self, trials):  # a fork that outlives the sweep's lock, as a worker may a killed sweep
        ready, say = os.pipe()
        self.child = os.fork()
        if self.child == 0:  # the fork's handlers have run: it says so, then lives on
            os.write(say, b"1")
            time.sleep(120)
            os._exit(0)
        os.read(ready, 1)
        return 0

    def save(self, row):
        pass

sc = SweepConfig(fixed={"dataset": "digits", "model": "mlp", "samples": 512, "device": "cpu"},
                 axes={"lr": [0.1]}, out=sys.argv[1])
r = Forks(sc)
r.run()
try:
    lock_dir(sc.out, "busy").close()
    free = True
except BadInput:
    free = False
os.kill(r.child, 9)
os.waitpid(r.child, 0)
print(json.dumps({"free": free}))
"""


def test_a_fork_of_the_sweep_does_not_keep_its_folder_locked(tmp_path):
    """flock's lock belongs to the open file, which a fork shares: a pool worker forked from the
    sweep that outlived it by a moment (SIGKILL) kept the next sweep in the folder out."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", LOCK_IN_A_FORK, str(tmp_path / "s")], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"free": True}
