"""Sweeps on an Optuna study (study.py, `sweep --storage URL --study NAME`): real storages
(SQLite, JournalFileStorage, and PostgreSQL from Debian's package when it is installed), real
`shmlearn sweep` processes sharing one study, kill -9, the pruners against the pooled sweep's
rule, and bad input in one line.

Multi-process tests wait on events (a trial RUNNING in the study, a process's exit), never on a
tight clock: CI is a loaded 2-core machine."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

optuna = pytest.importorskip("optuna", reason="optuna is not installed (pip install -e '.[test]')")

from optuna.trial import TrialState  # noqa: E402

from cli_inproc import run_main  # noqa: E402
from shmlearn.errors import BadInput  # noqa: E402
from shmlearn.sweeps.pruning import cannot_win  # noqa: E402
from shmlearn.sweeps.study.sweep import AreaPruner, distributions, make_pruner, open_storage, study_spec  # noqa: E402
from shmlearn.sweeps.sweep import SweepConfig, best_bounds, pick_winners  # noqa: E402

# digits + softmax: a trial trains in well under a second; 8 points.
GRID = ["--dataset", "digits", "--model", "softmax", "--samples", "4096", "--eval-points", "4", "--workers", "1",
        "--device", "cpu", "--batch-size", "16,32,64,128", "--lr", "0.1,0.3"]
# Long enough to be stopped mid-trial on a loaded machine: 600k samples of mlp, ~12 s a trial.
SLOW = ["--dataset", "digits", "--model", "mlp", "--samples", "600000", "--eval-points", "2", "--workers", "1",
        "--device", "cpu", "--batch-size", "32", "--lr", "0.05,0.1,0.2", "--no-report"]
# The kill -9 tests: short trials (256 steps, well under a second each), and the process to be
# killed runs with SHMLEARN_FAULT=sleep at step 5 of every trial (guard.Fault: an hour's sleep in its
# worker), so its trial is in flight when the kill comes however loaded the machine is; the
# processes that complete the study run without the fault. (They used SLOW: 3 x ~12 s trials
# after the kill, ~33 s a test.)
KILL = ["--dataset", "digits", "--model", "mlp", "--samples", "8192", "--eval-points", "2", "--workers", "1",
        "--device", "cpu", "--batch-size", "32", "--lr", "0.05,0.1,0.2", "--no-report"]
STUCK = "sleep:0:5"


def env():
    return dict(os.environ, PYTHONUNBUFFERED="1")


def sweep(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "shmlearn", "sweep", *args], capture_output=True, text=True,
                          timeout=timeout, env=env())


def sweeps(*arg_lists, timeout=900):
    """Several independent `shmlearn sweep` processes at once (their results in order): most of
    each one's time is imports and waits, so on 2 cores together they take well under the sum."""
    ps = [subprocess.Popen([sys.executable, "-m", "shmlearn", "sweep", *args], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env()) for args in arg_lists]
    try:
        outs = [p.communicate(timeout=timeout) for p in ps]
        return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(ps, outs)]
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()


def start(*args, log, fault=None):
    return subprocess.Popen([sys.executable, "-m", "shmlearn", "sweep", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=dict(env(), **({"SHMLEARN_FAULT": fault} if fault else {})))


def results(out):
    with open(os.path.join(out, "results.jsonl")) as f:
        return [json.loads(line) for line in f]


def load(storage, name):
    s = open_storage(storage)
    return optuna.load_study(study_name=name, storage=s)


def finished_by_id(study):
    by = {}
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and "row" in t.user_attrs:
            by.setdefault(t.user_attrs["row"]["id"], []).append(t.number)
    return by


def expected_ids(args):
    from shmlearn.cli.main import build_parser
    from shmlearn.sweeps.sweep import expand_grid, trial_id
    from shmlearn.sweeps.cli import sweep_config_from_args
    sc = sweep_config_from_args(build_parser().parse_args(["sweep", *args]))
    return [trial_id(c) for c in expand_grid(sc.fixed, sc.axes)], sc


# --- units ------------------------------------------------------------------------------------

def test_search_space_grid_values_tpe_ranges_and_log_scale():
    axes = {"workers": [1, 2, 4], "batch_size": [16, 512], "lr": [0.01, 0.03], "optimizer": ["sgd", "adam"]}
    grid = distributions(SweepConfig(axes=axes))
    assert all(isinstance(d, optuna.distributions.CategoricalDistribution) for d in grid.values())
    assert list(grid["lr"].choices) == [0.01, 0.03]
    d = distributions(SweepConfig(axes=axes, search="tpe", trials=5, storage="x", study="y"))
    assert isinstance(d["workers"], optuna.distributions.CategoricalDistribution)  # a layout: values only
    assert (d["batch_size"].low, d["batch_size"].high, d["batch_size"].log) == (16, 512, True)  # 32x: log
    assert (d["lr"].low, d["lr"].high, d["lr"].log) == (0.01, 0.03, False)
    assert list(d["optimizer"].choices) == ["sgd", "adam"]
    assert list(d) == ["workers", "batch_size", "lr", "optimizer"]


def test_pruner_names_are_optunas_pruners():
    sc = SweepConfig(threshold=1.5, target_accuracy=0.9, fixed={"workers": 4})
    area = make_pruner("area", sc)
    assert isinstance(area, optuna.pruners.BasePruner) and (area.threshold, area.target_accuracy, area.workers) == \
        (1.5, 0.9, 4)
    assert isinstance(make_pruner("median", sc), optuna.pruners.MedianPruner)
    assert isinstance(make_pruner("halving", sc), optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(make_pruner(None, sc), optuna.pruners.NopPruner)


def _row(w, area, min_loss=0.5, status="completed", curve=None):
    return {"id": f"w{w}-{area}", "status": status, "config": {"workers": w, "batch_size": 32, "lr": 0.1},
            "summary": {"loss_area": area, "min_loss": min_loss, "wall_time_s": 1.0},
            "eval_curve": curve or []}


def _study_with(rows):
    study = optuna.create_study(direction="minimize")
    for r in rows:
        t = study.ask()
        t.set_user_attr("row", r)
        study.tell(t, r["summary"]["loss_area"])
    return study


def _running(study, area, train_s, workers=None):
    t = study.ask()
    t.set_user_attr("shmlearn_progress", {"train_s": train_s})
    t.report(area, 1)
    return study._storage.get_trial(t._trial_id)


def test_area_pruner_is_the_pooled_sweeps_rule_over_the_studys_rows():
    rows = [_row(2, 3.0), _row(2, 1.0, min_loss=2.5),  # 1.0 did not learn (min loss > 1.8): no bound
            _row(2, 5.0), _row(2, 9.0, status="diverged")]
    study = _study_with(rows)
    p = AreaPruner(threshold=1.8, workers=2)
    assert p.bound(study, 2) == best_bounds(rows, 1.8, None)[2] == (3.0, None)
    for area, t in ((2.9, 100.0), (3.0, 1.0), (3.0001, 0.5), (50.0, 0.1)):
        ft = _running(study, area, t)
        assert p.prune(study, ft) == cannot_win(area, t, (3.0, -math.inf)), (area, t)
    assert p.prune(study, _running(study, 3.5, 1.0)) and not p.prune(study, _running(study, 2.0, 1.0))
    # With a target: a trial is saved while it may still reach the target first.
    rows = [_row(2, 3.0, curve=[[4.0, 0.95]])]
    study = _study_with(rows)
    p = AreaPruner(threshold=1.8, target_accuracy=0.9, workers=2)
    assert not p.prune(study, _running(study, 5.0, 3.0)) and p.prune(study, _running(study, 5.0, 4.5))
    assert not AreaPruner(workers=2).prune(optuna.create_study(), _running(optuna.create_study(), 9.0, 9.0))


def test_open_storage_bad_urls_are_bad_input(tmp_path, monkeypatch):
    import shmlearn.sweeps.study.sweep
    # The RDB storage's retries (processes started together race to create its tables) sleep 4.5 s
    # in all before the SQLite file in a missing directory is refused: not slept here.
    monkeypatch.setattr(shmlearn.sweeps.study.sweep.time, "sleep", lambda s: None)
    for url, words in ((f"sqlite:///{tmp_path}/no/such/dir/s.db", "unable to open database file"),
                       ("nosuchdb://x/y", "cannot open it"),
                       (f"journal:{tmp_path}/no/such/dir/j.log", "journal:FILE in a writable directory"),
                       ("journal:", "journal:FILE")):
        with pytest.raises(BadInput, match="--storage") as e:
            open_storage(url)
        assert words in str(e.value) and "\n" not in str(e.value)


# --- the CLI: bad input -----------------------------------------------------------------------

def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """The CLI's main() in this process (seven fresh interpreters took ~13 s of two cores; the
    tests around this one run the program itself to its exit 2 and one line)."""
    import shmlearn.sweeps.study.sweep
    from shmlearn.cli.main import main
    # The RDB storage's retries sleep 4.5 s in all before a storage is refused: not slept here.
    monkeypatch.setattr(shmlearn.sweeps.study.sweep.time, "sleep", lambda s: None)
    db = f"sqlite:///{tmp_path}/s.db"
    small = ["--dataset", "digits", "--model", "softmax", "--samples", "512", "--workers", "1", "--device", "cpu",
             "--eval-points", "1", "--no-report", "--out", str(tmp_path / "o")]
    cases = [
        (["--lr", "0.1,0.2", "--storage", f"sqlite:///{tmp_path}/nodir/s.db", "--study", "a"],
         "--storage sqlite:///" + str(tmp_path) + "/nodir/s.db: cannot open it"),
        (["--lr", "0.1,0.2", "--storage", "postgresql://me:hunter2@127.0.0.1:9/db", "--study", "a"],
         "--storage postgresql://me:***@127.0.0.1:9/db: cannot open it"),
        (["--lr", "0.1,0.2", "--storage", db], "needs --study NAME"),
        (["--lr", "0.1,0.2", "--search", "tpe"], "--search tpe: needs --storage URL"),
        (["--lr", "0.1,0.2", "--storage", db, "--study", "a", "--search", "tpe"], "needs --trials N"),
        (["--lr", "0.1,0.2", "--storage", db, "--study", "a", "--pruner", "median"], "only with --search tpe"),
        (["--lr", "0.1,0.2", "--storage", db, "--study", "a", "--search", "bayes"], "--search bayes: expected"),
    ]
    for args, words in cases:
        try:
            code = main(["sweep", *small, *args])
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2, (args, out, err)
        assert err.count("\n") == 1 and words in err and "Traceback" not in err, (args, err)
        assert "hunter2" not in err


def test_a_study_created_with_another_grid_is_refused(tmp_path, capfd, monkeypatch):
    from shmlearn.cli.main import main
    db = f"sqlite:///{tmp_path}/s.db"
    small = ["--dataset", "digits", "--model", "softmax", "--samples", "512", "--workers", "1", "--device", "cpu",
             "--eval-points", "1", "--no-report", "--batch-size", "64", "--storage", db, "--study", "s"]
    # The study to be refused, made by main() in this process (its trials in the pool's workers):
    # what is tested is the refusal below, not this program's process.
    r = run_main(["sweep", *small, "--lr", "0.1,0.2", "--out", str(tmp_path / "a")], monkeypatch, capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    # A study that shmlearn did not create is not taken over either. The two refusals: the CLI's
    # main() in this process, fd 2 read (two fresh interpreters were ~5 s of two cores here).
    optuna.create_study(study_name="theirs", storage=db).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    capfd.readouterr()
    refused = []
    for args in ([*small, "--lr", "0.1,0.3", "--out", str(tmp_path / "b")],
                 [*small[:-1], "theirs", "--lr", "0.1,0.2", "--out", str(tmp_path / "c")]):
        try:
            code = main(["sweep", *args])
        except SystemExit as e:
            code = e.code
        refused.append(subprocess.CompletedProcess(args, code, *capfd.readouterr()))
    r, theirs = refused
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--study s: created with another grid (--lr 0.1,0.2 there, 0.1,0.3 here)" in r.stderr
    assert not os.path.exists(tmp_path / "b" / "results.jsonl")
    r = theirs
    assert r.returncode == 2 and "an Optuna study that shmlearn did not create" in r.stderr, r.stderr


def test_optuna_missing_is_one_line_and_exit_2(tmp_path):
    code = ("import sys; sys.modules['optuna'] = None\n"  # import optuna now raises ImportError
            "from shmlearn.cli.main import main\n"
            f"sys.exit(main(['sweep', '--lr', '0.1,0.2', '--storage', 'sqlite:///{tmp_path}/s.db', '--study', 'a', "
            f"'--out', '{tmp_path}/o']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("shmlearn: error: --storage: optuna is not installed (optuna); "
                                "pip install 'shmlearn[optuna]'")


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    """{name: (folder, finished process)}: a 2-trial sweep without a storage and one on a study as
    srun's task 1 of 4, independent, started together (one 1-worker trial at a time each)."""
    small = ["--dataset", "digits", "--model", "softmax", "--samples", "512", "--workers", "1", "--device", "cpu",
             "--eval-points", "1", "--no-report", "--lr", "0.1,0.2"]
    pooled, srun = tmp_path_factory.mktemp("pooled"), tmp_path_factory.mktemp("srun")
    ps = [subprocess.Popen([sys.executable, "-m", "shmlearn", "sweep", *small, "--out", str(pooled / "o")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()),
          subprocess.Popen([sys.executable, "-m", "shmlearn", "sweep", *small, "--storage", f"sqlite:///{srun}/s.db",
                            "--study", "s", "--out", str(srun / "o")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=dict(env(), SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="4", SLURM_LOCALID="1"))]
    try:
        done = []
        for p in ps:
            o, e = p.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {"pooled": (pooled, done[0]), "srun": (srun, done[1])}


def test_without_storage_the_sweep_is_the_pooled_one(small_runs):
    tmp_path, r = small_runs["pooled"]
    assert r.returncode == 0, r.stdout + r.stderr
    spec = json.load(open(tmp_path / "o" / "sweep.json"))
    assert "study" not in spec and "storage" not in spec and "study " not in r.stdout
    assert len(results(tmp_path / "o")) == 2 and not os.path.exists(tmp_path / "o" / "study.db")


def test_under_srun_each_task_is_one_more_process_of_the_study(small_runs):
    tmp_path, r = small_runs["srun"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(results(tmp_path / "o")) == 2


# --- one process, real storages -----------------------------------------------------------------

@pytest.fixture(scope="module")
def grid_runs(tmp_path_factory):
    """{kind: (folder, storage URL, the first sweep's process)}: the SQLite and the journal
    storage's first GRID sweeps, independent, started together (each is one process training a
    1-worker trial at a time: one after the other they left a core idle)."""
    dirs = {kind: tmp_path_factory.mktemp(f"grid-{kind}") for kind in ("sqlite", "journal")}
    urls = {"sqlite": f"sqlite:///{dirs['sqlite']}/study.db", "journal": f"journal:{dirs['journal']}/study.log"}
    ran = sweeps(*[[*GRID, "--storage", urls[k], "--study", "g", "--out", str(dirs[k] / "out")] for k in dirs])
    return {k: (dirs[k], urls[k], r) for k, r in zip(dirs, ran)}


def _grid_once(grid_runs, kind, monkeypatch, capfd):
    tmp_path, storage, r = grid_runs[kind]
    out = str(tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    ids, sc = expected_ids(GRID)
    rows = results(out)
    assert sorted(r["id"] for r in rows) == sorted(ids) and [r["id"] for r in rows] == [i for i in ids]
    study = load(storage, "g")
    assert {i: len(n) for i, n in finished_by_id(study).items()} == {i: 1 for i in ids}
    assert study.user_attrs["shmlearn"] == study_spec(sc)
    w = json.load(open(os.path.join(out, "winners.json")))
    assert w == json.loads(json.dumps(pick_winners(rows, swept=["batch_size", "lr"], root=out)))  # with curves
    assert w["curves"]
    assert os.path.exists(os.path.join(out, "report.html"))
    for row in rows:  # each row's run directory is published, and the study's value is its area
        assert os.path.isfile(os.path.join(out, row["run_dir"], "summary.json"))
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        assert t.value == t.user_attrs["row"]["summary"]["loss_area"]
    # the same command again: main() in this process (what is tested is the study's account of
    # its trials, not a process)
    again = run_main(["sweep", *GRID, "--storage", storage, "--study", "g", "--out", out], monkeypatch, capfd)
    assert again.returncode == 0 and "(8 done)" in again.stdout and "ran " not in again.stdout, again.stdout
    assert len(load(storage, "g").trials) == len(study.trials)  # nothing asked, nothing run


def test_sqlite_grid_once_each_results_winners_report_from_the_study(grid_runs, monkeypatch, capfd):
    _grid_once(grid_runs, "sqlite", monkeypatch, capfd)


def test_journal_file_storage_grid(grid_runs, monkeypatch, capfd):
    _grid_once(grid_runs, "journal", monkeypatch, capfd)


PG_BIN = next((d for d in ("/usr/lib/postgresql/17/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/15/bin")
               if os.path.exists(os.path.join(d, "initdb"))), None)


@pytest.fixture
def postgres(tmp_path):
    """A PostgreSQL cluster of our own in a temp dir, on a Unix socket, as a cluster user would
    start one (initdb refuses root: as nobody then)."""
    if PG_BIN is None:
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")
    run_as = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser: initdb refuses root")
        run_as = ["runuser", "-u", "nobody", "--"]
    import pathlib
    import tempfile
    d = pathlib.Path(tempfile.mkdtemp(prefix="shmlearn-pg-"))  # not under pytest's root-only tmp
    os.chmod(d, 0o755)
    if run_as:
        shutil.chown(d, "nobody")
    data, sock = d / "data", d
    r = subprocess.run([*run_as, f"{PG_BIN}/initdb", "-D", str(data), "-U", "shm", "--auth=trust", "-E", "UTF8"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        shutil.rmtree(d, ignore_errors=True)
        pytest.skip(f"initdb failed here: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    log = d / "log.txt"
    r = subprocess.run([*run_as, f"{PG_BIN}/pg_ctl", "-D", str(data), "-l", str(log), "-w", "-t", "120", "-o",
                        f"-k {sock} -c listen_addresses='' -p 55432", "start"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        pytest.skip(f"pg_ctl start failed: {r.stdout[-300:]} {log.read_text()[-300:] if log.exists() else ''}")
    try:
        r = subprocess.run([*run_as, f"{PG_BIN}/createdb", "-h", str(sock), "-p", "55432", "-U", "shm", "study"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        yield f"postgresql+psycopg://shm@/study?host={sock}&port=55432"
    finally:
        subprocess.run([*run_as, f"{PG_BIN}/pg_ctl", "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(d, ignore_errors=True)


def test_postgresql_storage_two_processes(tmp_path, postgres):
    _two_processes(tmp_path, postgres)


# --- several processes ----------------------------------------------------------------------------

def _two_processes(tmp_path, storage):
    out = str(tmp_path / "shared")
    args = [*GRID, "--storage", storage, "--study", "two", "--out", out]
    ps = [start(*args, log=tmp_path / f"p{i}.txt") for i in (1, 2)]
    codes = [p.wait(timeout=900) for p in ps]
    logs = [(tmp_path / f"p{i}.txt").read_text() for i in (1, 2)]
    assert codes == [0, 0], logs
    ids, _ = expected_ids(GRID)
    study = load(storage, "two")
    runs = finished_by_id(study)
    assert {i: len(n) for i, n in runs.items()} == {i: 1 for i in ids}, runs  # every point exactly once
    # Together the processes ran every trial; each process's report covers all of them.
    ran = [{line.split()[1].rstrip(":") for line in log.splitlines() if line.startswith("[")} for log in logs]
    # Which process takes which trial is the scheduler's: on a loaded 2-core box one process can
    # start after the other has taken every point (seen once with PostgreSQL in CI). What must
    # hold is that no trial ran in both and together they ran the grid.
    assert not (ran[0] & ran[1]) and ran[0] | ran[1] == set(ids), ran
    rows = results(out)
    assert sorted(r["id"] for r in rows) == sorted(ids)
    w = json.load(open(os.path.join(out, "winners.json")))
    assert w["by_workers"]["1"]["survivors"] == len(ids)
    html = open(os.path.join(out, "report.html")).read()
    assert all(f"lr {lr}" in html or str(lr) in html for lr in ("0.1", "0.3"))
    assert len(os.listdir(os.path.join(out, "figures"))) > 0
    for i in ids:
        assert os.path.isfile(os.path.join(out, "trials", i, "summary.json"))
    return study


def test_two_processes_share_a_sqlite_study_each_trial_once(tmp_path):
    _two_processes(tmp_path, f"sqlite:///{tmp_path}/study.db")


def test_two_processes_share_a_journal_study_each_trial_once(tmp_path):
    _two_processes(tmp_path, f"journal:{tmp_path}/study.log")


def _wait_running(storage, name, pid, proc, deadline_s=600):
    """Block until process `pid` holds a RUNNING trial. The study is opened once and then read
    every 0.1 s: opening it each time (a new SQLAlchemy engine) and sleeping 0.5 s missed the
    whole of a 1-2 s trial on a loaded 2-core machine (CI, 2026-11-29)."""
    t_end = time.monotonic() + deadline_s
    study = None
    while time.monotonic() < t_end:
        assert proc.poll() is None, "the sweep ended before it was killed"
        if study is None:
            try:
                study = load(storage, name)
            except (KeyError, BadInput):
                time.sleep(0.2)
                continue
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            owner = t.user_attrs.get("shmlearn_owner") or {}
            tid = t.user_attrs.get("shmlearn_id")
            if owner.get("pid") == pid and tid:
                return t.number, tid
        time.sleep(0.1)
    raise AssertionError("no trial started")


def test_kill_9_loses_only_the_trial_in_flight_and_a_rerun_completes_it(tmp_path, monkeypatch, capfd):
    storage, out = f"sqlite:///{tmp_path}/study.db", str(tmp_path / "out")
    args = [*KILL, "--storage", storage, "--study", "k", "--out", out]
    ids, _ = expected_ids(KILL)
    p = start(*args, log=tmp_path / "first.txt", fault=STUCK)
    number, tid = _wait_running(storage, "k", p.pid, p)
    # Let it run a moment inside the trial (its worker stops at step 5), then kill -9: no chance to give
    # the trial back.
    time.sleep(0.5)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=120)
    study = load(storage, "k")
    t = study.trials[number]
    assert t.state == TrialState.RUNNING  # what a dead process leaves behind
    done_before = set(finished_by_id(study))
    r = run_main(["sweep", *args], monkeypatch, capfd)  # the rerun: main() in this process
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"trial #{number} ({tid}) lost: its process {p.pid}" in r.stdout and "queued again" in r.stdout, r.stdout
    study = load(storage, "k")
    assert study.trials[number].state == TrialState.FAIL and "shmlearn_lost" in study.trials[number].user_attrs
    runs = finished_by_id(study)
    assert {i: len(n) for i, n in runs.items()} == {i: 1 for i in ids}, runs
    ran_again = {line.split()[1].rstrip(":") for line in r.stdout.splitlines() if line.startswith("[")}
    assert tid in ran_again and not (ran_again & done_before), (ran_again, done_before)  # only what was not done
    assert sorted(r["id"] for r in results(out)) == sorted(ids)


def test_kill_9_of_one_process_the_other_completes_its_trial(tmp_path):
    storage, out = f"journal:{tmp_path}/study.log", str(tmp_path / "out")
    args = [*KILL, "--storage", storage, "--study", "k2", "--out", out]
    ids, _ = expected_ids(KILL)
    victim = start(*args, log=tmp_path / "victim.txt", fault=STUCK)
    number, tid = _wait_running(storage, "k2", victim.pid, victim)
    other = start(*args, log=tmp_path / "other.txt")
    time.sleep(0.5)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=120)
    assert other.wait(timeout=900) == 0, (tmp_path / "other.txt").read_text()
    log = (tmp_path / "other.txt").read_text()
    assert f"trial #{number} ({tid}) lost" in log, log
    runs = finished_by_id(load(storage, "k2"))
    assert {i: len(n) for i, n in runs.items()} == {i: 1 for i in ids}, runs
    assert sorted(r["id"] for r in results(out)) == sorted(ids)


def test_a_silent_trial_of_another_host_is_lost_after_stale_after_and_run_here(tmp_path, monkeypatch, capfd):
    """The cross-machine case: no pid to check, only a heartbeat that stopped moving."""
    storage, out = f"sqlite:///{tmp_path}/study.db", str(tmp_path / "out")
    args = ["--dataset", "digits", "--model", "softmax", "--samples", "512", "--workers", "1", "--device", "cpu",
            "--eval-points", "1", "--no-report", "--lr", "0.1,0.2", "--storage", storage, "--study", "h",
            "--out", out, "--stale-after", "3"]
    ids, sc = expected_ids(args)
    st = optuna.create_study(storage=storage, study_name="h", direction="minimize")
    st.set_user_attr("shmlearn", study_spec(sc))
    ghost = st.ask({"lr": optuna.distributions.CategoricalDistribution([0.1, 0.2])})
    ghost.set_user_attr("shmlearn_owner", {"host": "node-that-died", "pid": 1, "start": None})
    ghost.set_user_attr("shmlearn_beat", 7)
    r = run_main(["sweep", *args], monkeypatch, capfd)  # this host's sweep: main() in this process
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"trial #{ghost.number}" in r.stdout and "lost: no heartbeat for" in r.stdout, r.stdout
    study = load(storage, "h")
    assert study.trials[ghost.number].state == TrialState.FAIL
    assert {i: len(n) for i, n in finished_by_id(study).items()} == {i: 1 for i in ids}


def test_sigterm_gives_the_trial_back_at_once(tmp_path):
    storage, out = f"sqlite:///{tmp_path}/study.db", str(tmp_path / "out")
    # one trial in flight (on CPU cores the default runs two 1-worker trials at once)
    args = [*SLOW, "--parallel", "1", "--storage", storage, "--study", "t", "--out", out]
    p = start(*args, log=tmp_path / "log.txt")
    number, tid = _wait_running(storage, "t", p.pid, p)
    p.send_signal(signal.SIGTERM)  # what scancel or a preemption sends first
    assert p.wait(timeout=300) != 0
    study = load(storage, "t")
    assert study.trials[number].state == TrialState.FAIL
    assert study.trials[number].user_attrs["shmlearn_lost"] == "its process was interrupted"
    queued = [t for t in study.trials if t.state == TrialState.WAITING]
    assert [t.user_attrs["shmlearn_id"] for t in queued] == [tid]  # the next process runs it first


# --- pruning ----------------------------------------------------------------------------------

PRUNE = ["--dataset", "digits", "--model", "mlp", "--samples", "8192", "--workers", "1", "--device", "cpu",
         "--batch-size", "64", "--lr", "0.3,0.003,0.002,0.001", "--lr-schedule", "constant", "--no-report",
         "--threshold", "0.5"]
"""Only lr 0.3 gets below the threshold (min loss 0.06; the others 1.08 and more): loss areas are
seconds, and under load (two sweeps at once on 2 cores, beside other work) lr 0.003's area fell
below lr 0.3's in one sweep and not the other (1.8: both survivors), so the winners differed."""


def test_area_pruner_keeps_the_full_grids_winner(tmp_path, monkeypatch, capfd):
    """The winner (lr 0.3) is queued first (enqueue_trial, as a user may), so the others can be
    pruned; the winner is the full grid's, and each pruned run was already beaten."""
    storage = f"sqlite:///{tmp_path}/study.db"
    _, sc = expected_ids([*PRUNE, "--storage", storage, "--study", "p"])
    st = optuna.create_study(storage=storage, study_name="p", direction="minimize")
    st.set_user_attr("shmlearn", study_spec(sc))
    st.enqueue_trial({"lr": 0.3})
    # The full grid and the pruned study, independent, run together (one 1-worker trial at a time
    # each); the area pruner has no target here, so it compares areas, not times. The full grid is
    # a program; the study, main() in this process (a second program was a second interpreter and
    # forkserver importing torch on the same two cores).
    p = subprocess.Popen([sys.executable, "-m", "shmlearn", "sweep", *PRUNE, "--out", str(tmp_path / "full")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        r = run_main(["sweep", *PRUNE, "--prune", "--storage", storage, "--study", "p", "--out",
                      str(tmp_path / "pruned")], monkeypatch, capfd)
        full = subprocess.CompletedProcess(p.args, None, *p.communicate(timeout=900))
        full.returncode = p.returncode
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert full.returncode == 0, full.stderr
    assert r.returncode == 0, r.stdout + r.stderr
    rows = results(tmp_path / "pruned")
    wf = pick_winners(results(tmp_path / "full"), threshold=0.5, swept=["lr"])["by_workers"]["1"]["winner"]
    wp = pick_winners(rows, threshold=0.5, swept=["lr"])["by_workers"]["1"]["winner"]
    assert wf["id"] == wp["id"] and wp["lr"] == 0.3
    cut = [r for r in rows if r["status"] == "pruned"]
    assert cut, r.stdout
    for c in cut:
        assert c["pruned"]["pruner"] == "area" and c["pruned"]["area_so_far"] > wp["loss_area"]
        assert c["summary"]["steps"] < c["summary"]["planned_steps"]
    assert f"the area pruner stopped {len(cut)} trial" in r.stdout
    study = load(storage, "p")
    assert len(study.get_trials(states=(TrialState.PRUNED,))) == len(cut)
    assert "repeats" in r.stdout  # GridSampler handed out the queued point again: dropped, not rerun
    assert len(finished_by_id(study)) == 4 and all(len(v) == 1 for v in finished_by_id(study).values())


def test_tpe_with_median_pruner_reports_what_it_pruned(tmp_path, monkeypatch, capfd):
    storage, out = f"sqlite:///{tmp_path}/study.db", str(tmp_path / "out")
    args = ["--dataset", "digits", "--model", "mlp", "--samples", "50000", "--workers", "1", "--device", "cpu",
            "--batch-size", "16,128", "--lr", "0.0003,0.3", "--lr-schedule", "constant", "--eval-points", "8",
            "--storage", storage, "--study", "t", "--search", "tpe", "--trials", "10",
            "--search-seed", "3", "--pruner", "median", "--out", out]
    r = run_main(["sweep", *args], monkeypatch, capfd)  # main() in this process, its trials in the pool's workers
    assert r.returncode == 0, r.stdout + r.stderr
    study = load(storage, "t")
    counted = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(counted) == 10
    for t in counted:
        assert 16 <= t.params["batch_size"] <= 128 and 0.0003 <= t.params["lr"] <= 0.3
        steps = sorted(t.intermediate_values)  # the test loss at each eval point went to the study
        row = t.user_attrs["row"]
        why = (t.number, t.state, t.intermediate_values, row["status"], row.get("pruned"), r.stdout)
        if t.state == TrialState.PRUNED:
            assert steps[:2] == [1, 2], why
        elif row["status"] == "diverged":
            # TPE's picks follow the loss areas, which are seconds: on a loaded machine it may
            # pick batch 16 at lr ~0.2, which diverges (NaN) before its first eval point. Such a
            # trial is COMPLETE at +inf with the eval points it reached, none or a few.
            reached = [e for e in _json_lines(os.path.join(out, row["run_dir"], "eval.jsonl")) if e["samples"]]
            assert t.value == math.inf and steps == list(range(1, len(reached) + 1)) and len(reached) < 8, why
        else:
            assert row["status"] == "completed" and steps == list(range(1, 9)), why
    rows = results(out)
    assert len(rows) == 10 and len({r["id"] for r in rows}) == 10
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    spec = json.load(open(os.path.join(out, "sweep.json")))
    assert spec["pruner"] == "median" and len(spec["pruned"]) == len(pruned)
    for p in spec["pruned"]:
        row = next(r for r in rows if r["id"] == p["id"])
        assert row["status"] == "pruned" and p["pruner"] == "median" and p["step"] >= 2  # MedianPruner(n_warmup_steps=2)
        # Optuna's rule, checked: its best test loss so far was above the others' median there.
        assert p["best_so_far"] > p["peers"] and p["metric"] == "test loss"
        assert row["summary"]["steps"] < row["summary"]["planned_steps"]
    assert pruned, r.stdout  # lr 0.0003 and 0.3 in one range: some trials lag the median
    assert f"the median pruner stopped {len(pruned)} trial" in r.stdout
    html = open(os.path.join(out, "report.html")).read()
    assert "stopped by Optuna&#x27;s median pruner" in html and all(p["id"] in html for p in spec["pruned"])
    w = json.load(open(os.path.join(out, "winners.json")))
    assert w["overall"] is not None and w["by_workers"]["1"]["pruned"] == len(pruned)


# --- torn files and full disks (issue 38) -------------------------------------------------------

# Two 64-sample-batch trials of softmax on digits: a study of a few seconds, whose journal holds ~9 KB.
TINY = ["--dataset", "digits", "--model", "softmax", "--samples", "2048", "--eval-points", "2", "--workers", "1",
        "--device", "cpu", "--batch-size", "64", "--lr", "0.1,0.3", "--no-report"]


def _file_limit(limit):
    """preexec_fn: RLIMIT_FSIZE as a full disk (Python ignores SIGXFSZ: a write past it fails, EFBIG)."""
    def apply():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _sweep_limited(limit, *args):
    return subprocess.run([sys.executable, "-m", "shmlearn", "sweep", *args], capture_output=True, text=True,
                          timeout=900, env=env(), preexec_fn=_file_limit(limit))


def _json_lines(path):
    data = open(path, "rb").read()
    assert data.endswith(b"\n"), data[-80:]
    return [json.loads(line) for line in data.splitlines()]


def test_a_journal_torn_by_a_full_disk_or_a_cut_stays_readable_with_every_study(tmp_path, monkeypatch, capfd):
    """Issue 38, 1: study b on a journal that holds study a hits a full disk: one line naming the
    journal, exit 2, and the file as it was (no torn line). The file then cut 40 bytes short (a
    kill mid-write): the next run sets the torn line aside in study.log.torn and appends after
    whole lines; both studies then finish, and study a's finished trials are still there."""
    log = tmp_path / "study.log"
    url = f"journal:{log}"
    # study a, the journal's first: main() in this process (the programs below are what is tested)
    a = run_main(["sweep", *TINY, "--storage", url, "--study", "a", "--out", str(tmp_path / "a")], monkeypatch, capfd)
    assert a.returncode == 0, a.stderr
    size = log.stat().st_size
    trace = max(p.stat().st_size for p in (tmp_path / "a" / "trials").glob("*/trace.json"))
    limit = size + 4000  # the journal outgrows it in study b; a trial's files do not
    assert trace < limit
    b = _sweep_limited(limit, *TINY, "--storage", url, "--study", "b", "--out", str(tmp_path / "b"))
    assert b.returncode == 2, b.stdout + b.stderr
    lines = b.stderr.strip().splitlines()
    assert "Traceback" not in b.stderr and len(lines) == 1, b.stderr
    assert f"--storage {url}: the disk is full" in lines[0], lines[0]
    before = _json_lines(log)  # whole lines only: the failed write was cut back
    with open(log, "r+b") as f:  # a kill mid-write: the last line cut short
        f.truncate(log.stat().st_size - 40)
    # the runs after the cut: main() in this process (what is tested is the journal's repair)
    b = run_main(["sweep", *TINY, "--storage", url, "--study", "b", "--out", str(tmp_path / "b")], monkeypatch, capfd)
    assert b.returncode == 0 and "study.log.torn" in b.stderr, b.stdout + b.stderr
    assert (tmp_path / "study.log.torn").exists()
    assert len(_json_lines(log)) > len(before) - 1
    again = run_main(["sweep", *TINY, "--storage", url, "--study", "a", "--out", str(tmp_path / "a")], monkeypatch,
                     capfd)
    assert again.returncode == 0 and "(2 done)" in again.stdout, again.stdout + again.stderr
    assert len(finished_by_id(load(url, "a"))) == 2 and len(finished_by_id(load(url, "b"))) == 2


def test_a_random_search_over_fewer_points_than_trials_ends_when_each_was_asked_for(tmp_path):
    """Issue 38, 3: --search random --trials 5 over two optimizers (the only axis: 2 points) printed
    'repeats ...; dropped' forever. It says the space holds 2 points and ends after both."""
    url = f"sqlite:///{tmp_path}/study.db"
    args = [*TINY[:-5], "--batch-size", "64", "--lr", "0.1", "--optimizer", "sgd,momentum", "--no-report",
            "--search", "random", "--trials", "5", "--storage", url, "--study", "r", "--out", str(tmp_path / "out")]
    r = sweep(*args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the search space holds 2 distinct points, fewer than --trials 5" in r.stdout, r.stdout
    assert sorted(row["config"]["optimizer"] for row in results(tmp_path / "out")) == ["momentum", "sgd"]


def _refused_in_process(capfd, *args):
    """`shmlearn sweep ARGS` as the CLI's main() in this process, fd 1 and 2 read: for the refusals
    made before any worker starts (a fresh interpreter apiece was ~3 s of two cores)."""
    from shmlearn.cli.main import main
    capfd.readouterr()
    try:
        code = main(["sweep", *args])
    except SystemExit as e:
        code = e.code
    return subprocess.CompletedProcess(args, code, *capfd.readouterr())


def test_a_study_never_replaces_another_sweeps_results_and_locks_out(tmp_path, capfd, monkeypatch):
    """Issue 38, 4: a study on a pooled grid sweep's --out rewrote its results.jsonl (8 lines -> 2)
    and took no lock. Now it is refused in one line and the file is kept; a study shares --out's
    lock with its own processes only: a pooled sweep running there keeps it out, and it keeps a
    pooled sweep out. The refusals run in this process: flock's locks belong to the open file, so
    the lock held here below keeps this process's own sweep out as it keeps another's."""
    import fcntl
    out = tmp_path / "out"
    grid = run_main(["sweep", *TINY, "--out", str(out)], monkeypatch, capfd)  # the pooled sweep, in this process
    assert grid.returncode == 0, grid.stderr
    before = (out / "results.jsonl").read_bytes()
    url = f"sqlite:///{tmp_path}/study.db"
    study_args = [*TINY, "--storage", url, "--study", "s", "--out", str(out)]
    with open(out / ".lock", "a+") as held:  # a pooled sweep running there
        fcntl.flock(held, fcntl.LOCK_EX)
        busy = _refused_in_process(capfd, *study_args)
        fcntl.flock(held, fcntl.LOCK_UN)
        fcntl.flock(held, fcntl.LOCK_SH)  # a study running there
        pooled = _refused_in_process(capfd, *TINY, "--out", str(out))
    assert busy.returncode == 2 and "a sweep without --storage is running in this directory" in busy.stderr, busy.stderr
    assert pooled.returncode == 2 and "another sweep (or study) is running" in pooled.stderr, pooled.stderr
    r = _refused_in_process(capfd, *study_args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"--out {out}: holds a sweep without --storage (2 results in results.jsonl)" in r.stderr, r.stderr
    assert (out / "results.jsonl").read_bytes() == before


def test_sqlite_storage_on_a_full_disk_says_so_in_one_line(tmp_path):
    """Issue 38, 6: SQLite storage on a full disk gave three tracebacks ending in optuna's 'invalid
    data in the commit'. The database made by a first study, then no room to grow (RLIMIT_FSIZE
    at its size: SQLite says 'disk I/O error' for EFBIG, 'database or disk is full' for ENOSPC):
    one line naming --storage, exit 2."""
    url = f"sqlite:///{tmp_path}/study.db"
    s = optuna.create_study(storage=open_storage(url), study_name="first")
    s.enqueue_trial({"x": 1})
    size = (tmp_path / "study.db").stat().st_size
    r = _sweep_limited(size, *TINY, "--storage", url, "--study", "b", "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--storage {url}: cannot write it (SQLite: disk I/O error)" in lines[0], r.stderr


def test_a_stopped_process_whose_trial_was_taken_over_exits_0_with_its_finished_trial(tmp_path, monkeypatch, capfd):
    """Issue 38, 7: process A is stopped (SIGSTOP) with its trial training; B, --stale-after 3,
    takes the trial as lost and runs it. B deleted the shared .tmp/<id>-1 folder, where A's worker
    had finished the trial, so A, continued, exited 1 for a completed trial. Each process now runs
    attempts in its own folder: A says its trial finished after being taken over, and exits 0."""
    storage, out = f"sqlite:///{tmp_path}/study.db", str(tmp_path / "out")
    args = ["--dataset", "digits", "--model", "mlp", "--samples", "60000", "--eval-points", "2", "--workers", "1",
            "--device", "cpu", "--batch-size", "32", "--lr", "0.1", "--no-report", "--storage", storage,
            "--study", "p", "--out", out, "--stale-after", "3"]
    a = start(*args, log=tmp_path / "a.log")
    try:
        number, tid = _wait_running(storage, "p", a.pid, a)
        os.kill(a.pid, signal.SIGSTOP)  # the launcher only: its pool worker trains on
        b = run_main(["sweep", *args], monkeypatch, capfd)  # B: main() in this process (A is the process tested)
        assert b.returncode == 0 and f"trial #{number} ({tid}) lost: no heartbeat" in b.stdout, b.stdout + b.stderr
        os.kill(a.pid, signal.SIGCONT)
        a.wait(timeout=300)
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
            a.wait()
    log = (tmp_path / "a.log").read_text()
    assert a.returncode == 0, log
    assert f"trial #{number} ({tid}) finished here after another process took it as lost" in log, log
    assert {i: len(n) for i, n in finished_by_id(load(storage, "p")).items()} == {tid: 1}
    assert [r["id"] for r in results(out)] == [tid]
