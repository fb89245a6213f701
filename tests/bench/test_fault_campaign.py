"""benchmarks/fault_campaign.py's registry and runner: issue 53's classes hold 120 cases or more,
uniquely named, each command with an expected outcome; the runner classifies known outcomes as
it must (outside, traceback, a closed pipe's traceback, hang, lost, survived); two cheap real
cases run end to end."""
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks import faults  # noqa: E402
from benchmarks.faults import registry, runner  # noqa: E402
from benchmarks.faults.core import Cmd  # noqa: E402

faults.load_all()
NEW = [c for c in registry.CASES if c.klass not in registry.LEGACY]


def fake_fixture(tmp, name, dest="run"):
    """What the campaign's fixtures hold, in their formats, without training: enough for every
    case's build() (which damages these files) to run."""
    from shmlearn.train.checkpoint import write_file
    out = os.path.join(tmp, dest)
    os.makedirs(out)

    def put(n, text):
        with open(os.path.join(out, n), "w") as f:
            f.write(text)
    if name == "sweep":
        put("sweep.json", json.dumps({"fixed": {}, "axes": {"lr": [0.1, 0.2]}}))
        put("results.jsonl", "".join(json.dumps({"id": i, "workers": 1, "summary": {"status": "completed"}}) + "\n"
                                     for i in ("a", "b")))
        return out
    put("summary.json", json.dumps({"status": "completed", "test_accuracy": 0.9}))
    put("config.yaml", "lr: 0.1\n")
    put("metrics.jsonl", "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(0, 40, 10)))
    put("eval.jsonl", "".join(json.dumps({"step": s, "test_accuracy": 0.9}) + "\n" for s in (0, 30)))
    torch.save({"state_dict": {"w": torch.zeros(2)}, "data_spec": {"input_shape": [64]}}, os.path.join(out, "model.pt"))
    for step in (20, 40, 60):
        d = os.path.join(out, "checkpoints", f"step-{step:08d}")
        os.makedirs(d)
        write_file(os.path.join(d, "rank0.ckpt"), {"model": {"w": torch.zeros(2)}, "step": step})
    return out


def test_the_new_classes_hold_120_cases_uniquely_named():
    names = [c.name for c in registry.CASES]
    assert len(names) == len(set(names))
    classes = {c.klass for c in NEW}
    assert classes == set(faults.CLASSES) - set(registry.LEGACY)
    assert len(NEW) >= 120
    assert all(c.what and c.item == "53" for c in NEW)


def test_every_case_builds_commands_with_an_expected_outcome(tmp_path, monkeypatch):
    for name, mod in list(sys.modules.items()):
        if name.startswith("benchmarks.faults.") and hasattr(mod, "fixture"):
            monkeypatch.setattr(mod, "fixture", fake_fixture)
    for i, c in enumerate(registry.CASES):
        t = tmp_path / str(i)
        (t / "outside").mkdir(parents=True)
        cmds = c.build(str(t))
        assert cmds, c.name
        for cmd in cmds:
            for h in cmd.hold:
                h.close()
            assert cmd.args or cmd.argv, c.name
            codes = cmd.expect if isinstance(cmd.expect, set) else {cmd.expect}
            assert codes and all(isinstance(x, int) for x in codes), c.name


def _case(tmp_path, *cmds, keep=None):
    c = registry.Case("synthetic", "53", "a known outcome", lambda t: list(cmds), klass="test", keep=keep)
    return runner.run_case(c, str(tmp_path), str(tmp_path), limit=60)


def py(code):
    return ["-c", code]


def test_known_outcomes_are_classified(tmp_path):
    ok = _case(tmp_path / "ok", Cmd([], 2, argv=py("import sys; print('--lr: bad', file=sys.stderr); sys.exit(2)")))
    assert ok["verdict"] == "survived" and ok["results"][0]["exit"] == 2
    two = _case(tmp_path / "two", Cmd([], 2, argv=py("import sys; sys.stderr.write('a\\nb\\n'); sys.exit(2)")))
    assert two["verdict"] == "wrong" and "expected one" in two["results"][0]["wrong"][0]
    tb = _case(tmp_path / "tb", Cmd([], 1, argv=py("raise RuntimeError('x')")))
    assert tb["verdict"] == "traceback"
    # `| true`: the reader is gone, the first write fails, Python prints "Exception ignored" at exit
    pipe = _case(tmp_path / "pipe", Cmd([], {0, 1, 120}, argv=py("print('x' * 100)"), pipe="closed"))
    assert pipe["verdict"] == "traceback", pipe["results"][0]["stderr_tail"]
    # `| head -1`: the first line is read, the pipe closed; the write a second later fails
    head = _case(tmp_path / "head", Cmd([], {0, 1, 120}, argv=py("import time\nprint(1)\ntime.sleep(1)\nprint(2)"),
                                        pipe="head"))
    assert head["verdict"] == "traceback" and head["results"][0]["stdout_tail"] == "1"
    out = _case(tmp_path / "out", Cmd([], 0, argv=py("import os; open(os.path.join('..', 'outside', 'notes.txt'), "
                                                     "'a').write('x')")))
    assert out["verdict"] == "outside" and out["outside"] == ["outside --out: notes.txt changed"]
    hang = _case(tmp_path / "hang", Cmd([], 0, argv=py("import time; time.sleep(60)"), limit=2))
    assert hang["verdict"] == "hang" and hang["results"][0]["exit"] is None


def test_a_changed_file_in_a_kept_folder_is_lost(tmp_path):
    run = tmp_path / "lost" / "run"
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    lost = _case(tmp_path / "lost", Cmd([], 0, argv=py(f"open({str(run / 'summary.json')!r}, 'w').write('[]')")),
                 keep=lambda t: [str(run)])
    assert lost["verdict"] == "lost" and lost["lost"] == ["run/summary.json changed"]


@pytest.mark.parametrize("name", ["env-world-size-two", "yaml-top-level-list"])
def test_cheap_cases_end_to_end(tmp_path, name):
    """Whatever the code under test does, the verdict follows from what the run did: exit 2 in
    one line with no traceback survives, anything else does not."""
    c = next(c for c in registry.CASES if c.name == name)
    rec = runner.run_case(c, str(tmp_path), str(tmp_path), limit=120)
    r = rec["results"][0]
    assert r["exit"] is not None and not r["orphans"]["pids"]
    fine = r["exit"] == 2 and r["stderr_lines"] == 1 and not r["traceback"] and not r["wrong"]
    assert (rec["verdict"] == "survived") == fine, rec
