"""Issue 53: every file the program reads back goes through one reader (shmlearn/record/readback.py), and
anything malformed is one line naming the file and what is wrong, exit 2, no traceback: run and
sweep directories for `report` and `advise`, weights for load_model, checkpoints for --resume.
Also the numbers and arguments of issue 53 that used to pass or crash: simulate's, advise's
worker range, a sweep's threshold, --scheduler-args, a user loss, a streamed label dtype.

Run and sweep directories are written by hand (tests/report/conftest.make_run); the checkpoint
cases resume one real 1-worker run, copied per test."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from shmlearn.train import checkpoint
from shmlearn.errors import BadInput
from shmlearn.sweeps.results import ResultStore

from tests.cli_inproc import run_main
from tests.report.conftest import make_run


def refused(args, monkeypatch, capfd):
    """The one line of a refusal: exit 2, exactly one line on stderr, no traceback."""
    r = run_main(args, monkeypatch, capfd)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return lines[0]


@pytest.fixture
def run(tmp_path):
    make_run(tmp_path / "run", workers=1, batch=32, lr=0.1, strategy="allreduce")
    return tmp_path / "run"


@pytest.fixture
def sweep(tmp_path):
    out = tmp_path / "sweep"
    s, evals = make_run(out / "trials" / "t1", workers=1, batch=32, lr=0.1, strategy="allreduce")
    ResultStore(str(out / "results.jsonl")).append(
        {"id": "t1", "status": "completed", "summary": s, "run_dir": "trials/t1",
         "config": {"workers": 1, "batch_size": 32, "lr": 0.1}, "eval_curve": [[e["time_s"], e["test_accuracy"]]
                                                                            for e in evals]})
    (out / "sweep.json").write_text(json.dumps({"trials": ["t1"], "axis_order": [], "threshold": 1.8}))
    return out


# --- run directories ------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["report", "advise"])
def test_a_summary_that_is_a_list_is_one_line(run, monkeypatch, capfd, command):
    (run / "summary.json").write_text("[1, 2]")  # was AttributeError: 'list' object has no attribute 'get'
    line = refused([command, str(run)], monkeypatch, capfd)
    assert f"{run / 'summary.json'}: expected an object at the top, got a list" in line


def test_a_config_yaml_that_is_a_list_is_one_line(run, monkeypatch, capfd):
    (run / "config.yaml").write_text("- a\n- b\n")  # was TypeError in the run's label
    line = refused(["report", str(run)], monkeypatch, capfd)
    assert f"{run / 'config.yaml'}: expected an object at the top, got a list" in line


def test_a_garbage_line_in_metrics_is_named_for_advise(run, monkeypatch, capfd):
    rows = (run / "metrics.jsonl").read_text().splitlines()
    rows.insert(2, "garbage{")
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")  # was a JSONDecodeError traceback
    line = refused(["advise", str(run)], monkeypatch, capfd)
    assert f"{run / 'metrics.jsonl'} line 3: not valid JSON" in line and "garbage{" in line


def test_a_torn_last_line_of_metrics_is_what_a_kill_leaves_and_is_dropped(run):
    from shmlearn.record import readback
    whole = readback.run_metrics(str(run))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 70, "time_s"')  # no newline: a write cut off
    assert readback.run_metrics(str(run)) == whole


def test_a_missing_metrics_file_is_named_for_advise(run, monkeypatch, capfd):
    os.remove(run / "metrics.jsonl")  # was FileNotFoundError
    line = refused(["advise", str(run)], monkeypatch, capfd)
    assert f"{run / 'metrics.jsonl'}: no such file" in line


def test_a_string_accuracy_in_eval_is_named_for_report(run, monkeypatch, capfd):
    rows = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    rows[1]["test_accuracy"] = "0.9"
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = refused(["report", str(run)], monkeypatch, capfd)
    assert f"{run / 'eval.jsonl'} line 2: 'test_accuracy' is a string ('0.9'); expected a number or null" in line


# --- sweep directories ----------------------------------------------------------------------

@pytest.mark.parametrize("command", ["report", "advise"])
@pytest.mark.parametrize("text,needle", [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("[1, 2]", "expected an object at the top, got a list"),
    ('{"trials": "t1"}', "'trials' is a string ('t1'); expected a list"),
], ids=["not-json", "list", "trials-string"])
def test_a_malformed_sweep_json_is_one_line(sweep, monkeypatch, capfd, command, text, needle):
    (sweep / "sweep.json").write_text(text)
    line = refused([command, str(sweep)], monkeypatch, capfd)
    assert f"{sweep / 'sweep.json'}: {needle}" in line


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r["config"].pop("workers"), "'config': 'workers' is missing"),
    (lambda r: r.update(summary=None), "'summary' is null; expected an object"),
    (lambda r: r["summary"].update(min_loss="low"), "'summary': 'min_loss' is a string ('low'); expected a number"),
], ids=["no-workers", "summary-null", "min-loss-string"])
def test_a_malformed_results_row_is_one_line_naming_the_line(sweep, monkeypatch, capfd, edit, needle):
    row = json.loads((sweep / "results.jsonl").read_text())
    edit(row)
    (sweep / "results.jsonl").write_text(json.dumps(row) + "\n")  # were KeyError / AttributeError tracebacks
    line = refused(["report", str(sweep)], monkeypatch, capfd)
    assert f"{sweep / 'results.jsonl'} line 1 (a sweep result; fix or remove the line): {needle}" in line, line


def test_a_results_file_that_is_a_directory_is_one_line(sweep, monkeypatch, capfd):
    os.remove(sweep / "results.jsonl")
    os.mkdir(sweep / "results.jsonl")  # was IsADirectoryError
    line = refused(["report", str(sweep)], monkeypatch, capfd)
    assert f"{sweep / 'results.jsonl'}: is a directory; expected a file" in line


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    from shmlearn.record import readback
    os.mkfifo(tmp_path / "f.json")
    with pytest.raises(BadInput, match="not a regular file"):
        readback.read_json(str(tmp_path / "f.json"))  # an open() would block here for good


# --- weights (load_model) -------------------------------------------------------------------

class _Runs:
    """os.system when unpickled: what a planted model.pt would do."""

    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("blob,needle", [
    (_Runs(), "refused: it needs posix.system, and loading it could run code"),
    ([1, 2], "expected an object, got a list"),
    ({"state_dict": {}}, "'data_spec' is missing"),
    ({"state_dict": {"w": 1}, "data_spec": {"input_shape": [4]}}, "weight 'w' is not a tensor"),
], ids=["planted", "list", "no-spec", "not-tensor"])
def test_a_planted_or_malformed_model_pt_is_one_line(run, blob, needle):
    from shmlearn import load_model
    torch.save(blob, run / "model.pt")
    with pytest.raises(BadInput) as e:  # were UnpicklingError, TypeError, KeyError tracebacks
        load_model(str(run))
    assert str(e.value).startswith(f"{run / 'model.pt'}: ") and needle in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


# --- checkpoints (--resume) -----------------------------------------------------------------

RUN = ["--workers", "1", "--samples", "512", "--batch-size", "32", "--checkpoint-every", "8", "--threads", "1",
       "--no-progress"]


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A finished 1-worker run of 16 steps with checkpoints at steps 8 and 16."""
    from shmlearn import TrainConfig, train
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(TrainConfig(workers=1, samples=512, batch_size=32, checkpoint_every="8", threads=1, progress=False,
                      out=str(out)))
    assert checkpoint.candidates(str(out)) == [16, 8]
    return out


@pytest.fixture
def interrupted(checkpointed, tmp_path):
    """A copy of the run as a kill would leave it: no summary.json."""
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    os.remove(out / "summary.json")
    return out


def _only_newest(out):
    shutil.rmtree(checkpoint.step_dir(str(out), 8))
    return os.path.join(checkpoint.step_dir(str(out), 16), "rank0.ckpt")


def test_weights_of_the_wrong_shapes_name_the_file(checkpointed, tmp_path):
    """The campaign's read-load-model-wrong-shapes: the line named the run folder, not model.pt."""
    from shmlearn import load_model
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    blob = torch.load(run / "model.pt", weights_only=True)
    torch.save({**blob, "state_dict": {k: torch.zeros(3) for k in blob["state_dict"]}}, run / "model.pt")
    with pytest.raises(BadInput) as e:
        load_model(str(run))
    assert str(e.value).startswith(f"{run / 'model.pt'}: the weights do not fit the model mlp ("), str(e.value)


@pytest.mark.parametrize("edit,needle", [
    (lambda s: [1, 2], "malformed: "),
    (lambda s: {k: v for k, v in s.items() if k != "optimizer"}, "'optimizer' is missing"),
    (lambda s: {**s, "rng": None}, "'rng' is null; expected an object"),
], ids=["list", "no-optimizer", "rng-null"])
def test_a_malformed_checkpoint_is_exit_2_in_one_line(interrupted, monkeypatch, capfd, edit, needle):
    path = _only_newest(interrupted)
    checkpoint.write_file(path, edit(checkpoint.read_file(path)))  # a valid header over a bad payload: was exit 1
    line = refused(["train", "--resume", "--out", str(interrupted), *RUN], monkeypatch, capfd)
    assert f"--resume {interrupted}: no usable checkpoint ({path}: " in line and needle in line, line


def test_a_checkpoint_of_the_wrong_shapes_is_exit_2_in_one_line(interrupted, monkeypatch, capfd):
    path = _only_newest(interrupted)
    state = checkpoint.read_file(path)
    name = next(iter(state["model"]))
    state["model"][name] = torch.zeros(3, 3)
    checkpoint.write_file(path, state)
    line = refused(["train", "--resume", "--out", str(interrupted), *RUN], monkeypatch, capfd)
    assert "--resume: the checkpoint of step 16 does not fit this run's model or optimizer (RuntimeError: " in line


def test_a_malformed_newest_checkpoint_falls_back_to_the_previous_one(interrupted, monkeypatch, capfd):
    path = os.path.join(checkpoint.step_dir(str(interrupted), 16), "rank0.ckpt")
    checkpoint.write_file(path, [1, 2])
    r = run_main(["train", "--resume", "--out", str(interrupted), *RUN], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    assert "skipped damaged checkpoints" in r.stdout + r.stderr and "malformed" in r.stdout + r.stderr
    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["resumed_from_step"] == 8 and summary["steps"] == 16


def test_a_renamed_checkpoint_folder_does_not_resume_as_completed(interrupted, monkeypatch, capfd):
    """step-00000008 renamed step-00000016: it used to resume at 16 and say completed after 8 steps."""
    root = checkpoint.root(str(interrupted))
    shutil.rmtree(checkpoint.step_dir(str(interrupted), 16))
    os.rename(checkpoint.step_dir(str(interrupted), 8), checkpoint.step_dir(str(interrupted), 16))
    line = refused(["train", "--resume", "--out", str(interrupted), *RUN], monkeypatch, capfd)
    assert f"{root}/step-00000016/rank0.ckpt: holds step 8, not the folder's 16" in line, line
    assert not (interrupted / "summary.json").exists()


def _tree(out):
    """Every file under out and its bytes (the lock aside: taking it is no change)."""
    found = {}
    for d, _, names in os.walk(out):
        for n in names:
            if n != ".lock":
                with open(os.path.join(d, n), "rb") as f:
                    found[os.path.relpath(os.path.join(d, n), out)] = f.read()
    return found


def _insert_line(text, line):
    rows = text.splitlines()
    return "\n".join(rows[:1] + [line] + rows[1:]) + "\n"


@pytest.mark.parametrize("name,damage,needle", [
    ("summary.json", lambda t: '{"status": "compl', "summary.json: not valid JSON"),
    ("summary.json", lambda t: "[1, 2]", "summary.json: expected an object at the top, got a list"),
    ("config.yaml", lambda t: "- 1\n- 2\n", "config.yaml: expected an object at the top, got a list"),
    ("config.yaml", lambda t: "lr: [0.1\nworkers: {\n", "config.yaml: not valid YAML"),
    ("metrics.jsonl", lambda t: _insert_line(t, "not json {"), "metrics.jsonl line 2: not valid JSON"),
    ("eval.jsonl", lambda t: _insert_line(t, "[1, 2]"), "eval.jsonl line 2: expected a JSON object, got a list"),
], ids=["summary-not-json", "summary-list", "config-list", "config-not-yaml", "metrics-garbage", "eval-list-row"])
def test_resume_refuses_a_damaged_run_file_and_rewrites_nothing(interrupted, monkeypatch, capfd, name, damage,
                                                               needle):
    """The campaign's read-resume-*: --resume took a damaged summary.json for no summary and
    resumed from the checkpoints, rewriting config.yaml, cutting the logs and pruning checkpoints."""
    path = interrupted / name
    path.write_text(damage(path.read_text() if path.exists() else ""))
    before = _tree(interrupted)
    line = refused(["train", "--resume", "--out", str(interrupted), *RUN], monkeypatch, capfd)
    assert f"{interrupted}/{needle}" in line, line
    assert _tree(interrupted) == before


def _finished_on_rank(rank, port, run_dir, out):
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        checkpoint.finished(run_dir, rank, 2)
        said = "returned"
    except BadInput as e:
        said = str(e)
    with open(f"{out}.{rank}", "w") as f:
        f.write(said)
    dist.destroy_process_group()


def test_under_a_launcher_every_rank_gets_rank_0s_refusal(interrupted, tmp_path):
    """Under torchrun rank 0 reads the run's files and broadcasts what it found: a refusal on rank
    0 alone would leave rank 1 waiting in the broadcast until --timeout."""
    from shmlearn.launch.start import free_port
    from tests.procs import processes
    (interrupted / "summary.json").write_text("[1, 2]")
    processes(_finished_on_rank, (free_port(), str(interrupted), str(tmp_path / "said")), 2)
    said = [(tmp_path / f"said.{r}").read_text() for r in (0, 1)]
    assert said[0] == said[1] and f"{interrupted / 'summary.json'}: expected an object" in said[0], said


def test_resume_of_a_whole_stopped_run_still_continues(interrupted):
    from shmlearn.record import readback
    assert readback.resume_check(str(interrupted)) is None  # nothing damaged: resumed, as before
    summary = {"status": "completed", "steps": 16}
    (interrupted / "summary.json").write_text(json.dumps(summary))
    (interrupted / "metrics.jsonl").write_text("not json {\n")  # an ended run is never read past its summary
    assert readback.resume_check(str(interrupted)) == summary


def test_a_fifo_in_place_of_a_checkpoint_never_blocks(interrupted):
    path = _only_newest(interrupted)
    os.remove(path)
    os.mkfifo(path)  # an open() for reading blocks until a writer comes: the run hung for good
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "shmlearn", "train", "--resume", "--out", str(interrupted), *RUN],
                       capture_output=True, text=True, timeout=300, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{path}: not a regular file (a FIFO, socket or device)" in lines[0]


# --- numbers and arguments ------------------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--net-bw", "0"], "--net-bw 0.0: expected a finite number > 0 GB/s"),      # was ZeroDivisionError
    (["--net-bw", "nan"], "--net-bw nan: expected a finite number > 0 GB/s"),    # was exit 0
    (["--net-bw", "-5"], "--net-bw -5.0: expected a finite number > 0 GB/s"),    # was exit 0
    (["--net-bw", "10", "--slots", "0"], "--slots 0.0: expected a finite number > 0"),  # was exit 0
    (["--net-bw", "10", "--net-latency-us", "inf"], "--net-latency-us inf: expected a finite number >= 0"),
], ids=["bw-0", "bw-nan", "bw-neg", "slots-0", "latency-inf"])
def test_simulate_refuses_numbers_it_cannot_model(run, tmp_path, monkeypatch, capfd, flags, needle):
    line = refused(["simulate", "--compute", str(run), *flags, "--out", str(tmp_path / "sim")], monkeypatch, capfd)
    assert needle in line, line
    assert not (tmp_path / "sim").exists()


def test_advise_refuses_a_huge_worker_range_with_the_bound(run, monkeypatch, capfd):
    line = refused(["advise", str(run), "--workers", "1-1000000000"], monkeypatch, capfd)  # was MemoryError
    assert "--workers 1-1000000000: 1,000,000,000 values in 1-1000000000; expected at most 100,000" in line


def test_a_sweep_threshold_of_nan_is_refused(tmp_path, monkeypatch, capfd):
    line = refused(["sweep", "--threshold", "nan", "--out", str(tmp_path / "sw")], monkeypatch, capfd)  # was exit 0
    assert "--threshold nan: expected a finite number" in line and not (tmp_path / "sw").exists()


def test_a_stale_after_of_nan_is_refused_without_storage_too(tmp_path, monkeypatch, capfd):
    """The fault campaign's num-sweep--stale-after=nan: checked only with --storage, so a plain sweep
    took nan and exited 0."""
    line = refused(["sweep", "--stale-after", "nan", "--out", str(tmp_path / "sw")], monkeypatch, capfd)
    assert "--stale-after nan: expected seconds > 0" in line and not (tmp_path / "sw").exists()


@pytest.mark.parametrize("sched,args,needle", [
    ("StepLR", "step_size=0", "--scheduler-args step_size=0: step_size=0; expected a whole number >= 1"),
    ("StepLR", "step_size=1,gamma=nan", "--scheduler-args step_size=1,gamma=nan: gamma=nan; expected finite numbers"),
    # torch takes these, and trains: a decay at every step, a cosine run backwards (were exit 0)
    ("StepLR", "step_size=-1", "--scheduler-args step_size=-1: step_size=-1; expected a whole number >= 1"),
    ("CosineAnnealingLR", "T_max=-5", "--scheduler-args T_max=-5: T_max=-5; expected a whole number >= 1"),
    ("StepLR", "step_size=2.5", "--scheduler-args step_size=2.5: step_size=2.5; expected a whole number >= 1"),
    ("CosineAnnealingLR", "T_max=0,eta_min=0.5", "--scheduler-args T_max=0,eta_min=0.5: T_max=0; expected a"),
], ids=["step-size-0", "gamma-nan", "step-size-negative", "t-max-negative", "step-size-fraction", "t-max-0"])
def test_scheduler_arguments_that_cannot_run_are_refused_before_workers(tmp_path, monkeypatch, capfd, sched, args,
                                                                        needle):
    line = refused(["train", "--workers", "2", "--optimizer", "Adadelta", "--scheduler", sched,
                    "--scheduler-args", args, "--out", str(tmp_path / "r")], monkeypatch, capfd)  # were exit 1
    assert needle in line, line
    assert not (tmp_path / "r").exists()  # before the run directory, so before any worker


LOSSES = '''import torch
import torch.nn.functional as F

def as_float(out, y):
    return float(F.cross_entropy(out, y))

def per_sample(out, y):
    return F.cross_entropy(out, y, reduction="none")
'''


@pytest.mark.parametrize("name,needle", [
    ("as_float", "returned a float; expected a tensor holding the batch's mean loss"),
    ("per_sample", "returned a tensor of shape (2,); expected the batch's mean loss, one number"),
])
def test_a_user_loss_that_is_not_a_scalar_is_named_before_training(tmp_path, monkeypatch, capfd, name, needle):
    (tmp_path / "losses.py").write_text(LOSSES)
    ref = f"{tmp_path / 'losses.py'}:{name}"
    line = refused(["train", "--workers", "1", "--loss", ref, "--samples", "256", "--out", str(tmp_path / "r"),
                    "--no-progress"], monkeypatch, capfd)
    assert f"--loss {ref}: {needle}" in line, line
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # before the run directory's files: no step trained


DATASET = '''import torch
from torch.utils.data import Dataset

class Mixed(Dataset):
    classes = [0, 1, 2]  # torchvision's attribute: the labels are not scanned up front

    def __init__(self, n, float_from):
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
        self.float_from = float_from

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], (i % 3 + 0.5 if i >= self.float_from else i % 3)

def data():
    return Mixed(64, 40), Mixed(16, 10**9)
'''


def test_a_label_dtype_that_changes_mid_stream_is_refused_naming_the_item(tmp_path, monkeypatch, capfd):
    (tmp_path / "mixed.py").write_text(DATASET)
    ref = f"{tmp_path / 'mixed.py'}:data"
    line = refused(["train", "--workers", "1", "--dataset", ref, "--loader", "stream", "--batch-size", "64",
                    "--epochs", "1", "--out", str(tmp_path / "r"), "--no-progress"], monkeypatch, capfd)
    # the one batch holds every item; the first float label is item 40 (was: trained on, 2.5 read as 2)
    assert (f"--dataset {ref}: the train Dataset's item 40 has a label of dtype float64, but item 0's is int64"
            in line), line
