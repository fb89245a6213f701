"""A sweep packs its trials into its slots (issue 37): 1-worker trials run side by side, one per
slot, and a 2-worker trial waits until it has two slots to itself. Real processes and Gloo on the
CPU, as on GPUs where a slot is a GPU. The trials train a user model whose forward stamps
(process, world size, time) into a file, so the test sees when each process was training."""
import collections
import json
import textwrap

from shmlearn.sweeps.sweep import SweepConfig
from shmlearn.sweeps.cli import run_sweep

NET = """
    import os
    import time

    import torch.distributed as dist
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            world = dist.get_world_size() if dist.is_initialized() else 1
            with open(os.environ["SHMLEARN_TEST_STAMPS"], "a") as f:
                f.write(f"{os.getpid()} {world} {time.time()}\\n")
            return self.fc(x.flatten(1))
"""


def test_one_worker_trials_share_the_slots_and_a_two_worker_trial_waits_for_both(tmp_path, monkeypatch, capsys):
    (tmp_path / "net.py").write_text(textwrap.dedent(NET))
    stamps = tmp_path / "stamps.txt"
    monkeypatch.setenv("SHMLEARN_TEST_STAMPS", str(stamps))
    fixed = dict(model=f"{tmp_path / 'net.py'}:Net", dataset="digits", samples=6400, batch_size=16,
                 eval_points=1, threads=1, device="cpu", progress=False)
    sc = SweepConfig(fixed=fixed, axes={"workers": [1, 2], "lr": [0.05, 0.1]}, parallel=2, slots=2,
                     out=str(tmp_path / "sweep"), report=False)
    assert run_sweep(sc) == 0
    # What it says it will do: the 1-worker trials two at a time, the 2-worker ones alone.
    assert "4 trials (0 done, 4 to run), up to 2 at a time on 2 CPU cores" in capsys.readouterr().out
    rows = [json.loads(line) for line in open(tmp_path / "sweep" / "results.jsonl")]
    assert len(rows) == 4 and all(r["status"] == "completed" for r in rows)
    assert {r["config"]["workers"]: r["slots"] for r in rows} == {1: 1, 2: 2}
    span = collections.defaultdict(lambda: [float("inf"), 0.0])  # (pid, world) -> [first, last]
    for pid, world, t in (line.split() for line in stamps.read_text().splitlines()):
        s = span[int(pid), int(world)]
        s[0], s[1] = min(s[0], float(t)), max(s[1], float(t))
    one = [v for (_, w), v in span.items() if w == 1]
    two = [v for (_, w), v in span.items() if w == 2]
    assert len(one) == 2 and len(two) == 2, dict(span)  # the 1-worker trials ran in 2 processes
    assert one[0][0] < one[1][1] and one[1][0] < one[0][1], one  # side by side
    assert max(v[1] for v in one) < min(v[0] for v in two), (one, two)  # the 2-worker trials waited


def test_the_next_trial_starts_before_the_last_one_is_recorded(tmp_path, monkeypatch):
    """A slot does not wait for the sweep's bookkeeping of the trial that left it (publishing its
    folder, its config.yaml, results.jsonl): one slot, one trial at a time, and each trial after
    the first started before the one before it was recorded (timing.json: start_unix is taken
    when a trial starts, end_unix when it is recorded)."""
    import shmlearn.sweeps.trials as trials

    record = trials.TrialRunner.record
    order = []

    def recording(self, cfg, tid, *a, **k):
        order.append(("record", tid))
        return record(self, cfg, tid, *a, **k)
    start = trials.TrialRunner.start

    def starting(self, cfg, *a, **k):
        r = start(self, cfg, *a, **k)
        order.append(("start", r.tid))
        return r
    monkeypatch.setattr(trials.TrialRunner, "record", recording)
    monkeypatch.setattr(trials.TrialRunner, "start", starting)
    fixed = dict(model="mlp", dataset="digits", samples=640, batch_size=32, eval_points=1, threads=1, workers=1,
                 device="cpu", progress=False)
    sc = SweepConfig(fixed=fixed, axes={"lr": [0.05, 0.1, 0.2]}, parallel=1, slots=1, out=str(tmp_path / "sweep"),
                     report=False)
    assert run_sweep(sc) == 0
    starts = [tid for what, tid in order if what == "start"]
    assert len(starts) == 3
    # start 1, start 2, record 1, start 3, record 2, record 3
    assert order == [("start", starts[0]), ("start", starts[1]), ("record", starts[0]), ("start", starts[2]),
                     ("record", starts[1]), ("record", starts[2])], order
    rows = json.load(open(tmp_path / "sweep" / "timing.json"))["overhead_s"]
    assert all(0 < r["s"] < 5 for r in rows)  # each trial's overhead ends when it ended, not when recorded


def test_a_trial_folder_is_fsynced_by_the_sweep_before_it_is_published(tmp_path, monkeypatch):
    """A trial writes its whole files unsynced (record/runs.py published): the sweep fsyncs its
    summary.json and config.yaml (rewritten to name the published folder) in the attempt's folder,
    before the one rename that publishes it."""
    import os
    import yaml
    import shmlearn.sweeps.trials as trials

    events = []
    fsync, rename = os.fsync, os.rename

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recording_rename(a, b):
        events.append(("rename", str(a)))
        return rename(a, b)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(trials.os, "rename", recording_rename)
    fixed = dict(model="mlp", dataset="digits", samples=640, batch_size=32, eval_points=1, threads=1, workers=1,
                 device="cpu", progress=False)
    out = tmp_path / "sweep"
    sc = SweepConfig(fixed=fixed, axes={"lr": [0.05, 0.1]}, parallel=1, slots=1, out=str(out), report=False)
    assert run_sweep(sc) == 0
    published = [i for i, (what, _) in enumerate(events) if what == "rename"]
    assert len(published) == 2
    for i in published:
        tmp = events[i][1]
        synced = {os.path.basename(p).split(".tmp.")[0] for what, p in events[:i]
                  if what == "fsync" and os.path.dirname(p) == tmp}
        assert {"summary.json", "config.yaml"} <= synced, (tmp, events[:i])
    for row in map(json.loads, open(out / "results.jsonl")):
        run = out / row["run_dir"]
        assert yaml.safe_load(open(run / "config.yaml"))["out"] == str(run)
