"""Launcher detection, and real multi-process runs under torchrun, mpirun and an srun-shaped env."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from shmlearn.launch.start import detect_env, free_port
from procs import mpirun_env

ARGS = ["train", "--epochs", "2", "--eval-points", "1", "--no-progress"]


def test_no_launcher_means_none():
    assert detect_env({}) is None
    # inside an sbatch script (no srun step) shmlearn must not think it is rank 0 of N
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}) is None


def test_torchrun_env():
    e = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.launcher) == (3, 8, 1, 2, "torchrun")
    assert e.init_method == "tcp://10.0.0.1:1234"


def test_openmpi_and_pmi_env():
    e = detect_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                    "OMPI_MCA_ess_base_jobid": "12345"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.launcher) == (1, 4, 1, 2, "mpirun")
    e2 = detect_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                     "OMPI_MCA_ess_base_jobid": "12345"})
    assert e.master_port == e2.master_port  # ranks agree on the port without talking
    p = detect_env({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0"})
    assert (p.rank, p.world_size, p.launcher) == (2, 3, "mpirun")


def test_srun_env_and_nodelist():
    e = detect_env({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
                    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]",
                    "SLURM_JOB_ID": "99", "SLURM_STEP_ID": "0"})
    assert (e.rank, e.world_size, e.local_rank, e.launcher, e.master_addr) == (5, 8, 1, "srun", "gpu07")
    from shmlearn.launch.env import _first_host  # the one parser of the launcher's variables
    assert _first_host("node[03-05,07],gpu1") == "node03"
    assert _first_host("a1,b2") == "a1"
    assert _first_host("n[1,4]") == "n1"


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _srun_env(rank: int, port: str, job: str):
    """What srun gives task `rank` of a 2-task, 1-node job step (the real srun is not installable here)."""
    return _clean_env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_STEP_NUM_TASKS="2",
                      SLURM_STEP_NUM_NODES="1", SLURM_JOB_ID=job, SLURM_STEP_ID="0", MASTER_PORT=port)


def _summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def test_torchrun_runs_unchanged(tmp_path):
    out = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), "-m", "shmlearn", *ARGS, "--out", out],
                       capture_output=True, text=True, timeout=300, env=_clean_env())
    assert r.returncode == 0, r.stderr[-2000:]
    s = _summary(out)
    assert (s["launcher"], s["workers"], s["status"]) == ("torchrun", 2, "completed")
    assert r.stdout.count("test accuracy") == 1  # only rank 0 prints the result


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun (apt-get install openmpi-bin)")
def test_mpirun_runs_unchanged(tmp_path):
    out = str(tmp_path / "run")
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "-x", "PYTHONUNBUFFERED", "-x", "PATH",
           sys.executable, "-m", "shmlearn", *ARGS, "--out", out]
    if os.geteuid() == 0:
        cmd[1:1] = ["--allow-run-as-root"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=mpirun_env(_clean_env(MASTER_PORT=str(free_port()))))
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    s = _summary(out)
    assert (s["launcher"], s["workers"], s["processes"]) == ("mpirun", 2, 2)


def test_srun_shaped_environment(tmp_path):
    """What srun gives each task is its environment; two processes with srun's variables must
    find each other (the real srun is not installable here)."""
    out, port = str(tmp_path / "run"), str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "shmlearn", *ARGS, "--out", out],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_srun_env(r, port, "42"))
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1000:] for o in outs]
    s = _summary(out)
    assert (s["launcher"], s["workers"]) == ("srun", 2)


def test_workers_flag_must_match_launcher(tmp_path, capfd, monkeypatch):
    """The CLI's main() in this process, in a one-rank torchrun job's environment (the refusal comes
    before any process group; a fresh interpreter was ~3 s of two cores here), fd 2 read."""
    from shmlearn.cli.main import main
    for k in list(os.environ):
        if k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_")):
            monkeypatch.delenv(k)
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    capfd.readouterr()
    try:
        code = main([*ARGS, "--workers", "3", "--out", str(tmp_path / "r")])
    except SystemExit as e:
        code = e.code
    r = subprocess.CompletedProcess([], code, *capfd.readouterr())
    assert r.returncode == 2 and "--workers 3" in r.stderr and len(r.stderr.strip().splitlines()) == 1


_ATTEMPT = """
import os, sys, torch, torch.distributed as dist
from shmlearn.launch.start import detect_env, init_process_group
init_process_group("gloo", detect_env(), 20)
t = torch.ones(1)
dist.all_reduce(t)
print(int(t.item()), flush=True)
os._exit(0)  # leave like a killed worker: the group is never destroyed, its keys stay in the store
"""


def test_torchrun_restart_does_not_read_the_dead_attempts_addresses():
    """torchrun keeps one store across restarts; a rank of attempt 1 that starts before its peer
    must wait for the peer's new address, not connect to the old one (CI saw 'Connection refused')."""
    import time

    from torch.distributed import TCPStore

    port = free_port()
    server = TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)  # the agent's store

    def start(rank, attempt):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_"))}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RESTART_COUNT=str(attempt))
        return subprocess.Popen([sys.executable, "-c", _ATTEMPT], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    first = [start(0, 0), start(1, 0)]
    assert [p.communicate(timeout=120)[0].strip() for p in first] == ["2", "2"]
    late = start(1, 1)
    time.sleep(3)  # rank 1 of the new attempt is in the store well before rank 0
    second = [start(0, 1), late]
    outs = [p.communicate(timeout=120) for p in second]
    assert [o.strip() for o, _ in outs] == ["2", "2"], [e[-500:] for _, e in outs]
    del server


_ENTRY = """
import atexit, sys
atexit.register(lambda: print("interpreter teardown ran", flush=True))
sys.argv = ["shmlearn", "train", "--workers", "1", "--samples", "640", "--eval-points", "1", "--no-progress",
            "--out", sys.argv[1]]
from shmlearn.cli.main import entry
entry()
"""


@pytest.mark.parametrize("launched", [True, False])
def test_a_launched_rank_skips_interpreter_teardown(tmp_path, launched):
    """Under torchrun/mpirun/srun the program leaves with os._exit once its output is flushed
    (exit-time teardown aborted finished mpirun ranks); run by hand it exits normally."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC")) and k not in ("RANK", "WORLD_SIZE")}
    if launched:  # a one-rank torchrun job
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, "-c", _ENTRY, str(tmp_path / "run")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "test accuracy" in r.stdout and (tmp_path / "run" / "summary.json").exists()
    assert ("interpreter teardown ran" in r.stdout) is not launched


USER_SCRIPT = """
import os, sys
from shmlearn import train
from shmlearn.config.train_config import TrainConfig
train(TrainConfig(epochs=1, eval_points=1, progress=False, out=sys.argv[1]))
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print("threads:", ",".join(threads))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux's /proc")
def test_a_script_calling_train_under_a_launcher_is_left_without_the_groups_threads(tmp_path):
    """shmlearn.train() called from a user's script, as a rank of a launcher (srun's variables
    here): when it returns, the process group must be gone, threads and all. torch's first
    optimizer used to pin the group (see launch.init_process_group), its Gloo threads outlived
    destroy_process_group, and the interpreter's exit then aborted finished ranks under mpirun."""
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    out, port = str(tmp_path / "run"), str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), out], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_srun_env(r, port, "43"))
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1000:] for o in outs]
    for stdout, _ in outs:
        threads = next(line for line in stdout.splitlines() if line.startswith("threads:"))
        assert "gloo" not in threads, threads


def test_capacity_messages_count_one_core_and_one_slot(monkeypatch):
    """'1 cores', '1 free slots': a count of one reads as one."""
    import shmlearn.launch.pool
    from shmlearn.errors import BadInput
    from shmlearn.launch.start import check_capacity
    from shmlearn.launch.pool import run_local
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(BadInput, match=r"17 processes on 1 core \(at most 16\)"):
        check_capacity(17, None, False)
    with pytest.raises(BadInput, match=r"more than 4 per core \(1 core\)"):
        check_capacity(1, 5, False)

    class Pool:
        slots = [0, 1, 2, 3]
        def free_slots(self):
            return [3]
    monkeypatch.setattr(shmlearn.launch.pool, "current", lambda: Pool())
    with pytest.raises(BadInput, match="the pool has 1 free slot of 4"):
        run_local(print, (), 2, cuda=True, timeout_s=1.0)


def test_rank_0_stopped_during_a_launchers_rendezvous_is_one_line_naming_rank_0_or_the_launcher(tmp_path):
    """Issue 38, 9: under a launcher rank 0 hosts the store. SIGSTOP of rank 0 as the ranks
    start: rank 1 printed torch's C++ connect warnings (30-frame stack traces) and a Python
    traceback (DistNetworkError). Now one line: which rank gave up, and that rank 0 or the
    launcher does not answer. --timeout 3: rank 0 is stopped before it hosts the store, so no
    healthy wait depends on it; it is only how long rank 1 waits before it gives up."""
    import signal
    import time
    port = free_port()
    ranks = []
    for r in range(2):
        env = dict(os.environ, PYTHONUNBUFFERED="1", RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen([sys.executable, "-m", "shmlearn", "train", "--dataset", "digits", "--model",
                                       "mlp", "--workers", "2", "--samples", "12800", "--timeout", "3",
                                       "--no-progress", "--out", str(tmp_path / "run")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        time.sleep(0.5)
        os.kill(ranks[0].pid, signal.SIGSTOP)
        _, err = ranks[1].communicate(timeout=300)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert ranks[1].returncode == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("shmlearn: failed: rank 1: the rendezvous timed out after 3 s (--timeout): rank 0 or "
                          "the launcher does not answer"), err


_FINDER = '''
import importlib.util, sys
from importlib.machinery import PathFinder
REPO = {repo!r}

class _Installed:
    """An editable install's finder (setuptools'): shmlearn found by sys.meta_path, not sys.path."""
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "shmlearn":
            return importlib.util.spec_from_file_location(
                name, REPO + "/shmlearn/__init__.py", submodule_search_locations=[REPO + "/shmlearn"])
        return None

sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, _Installed)
'''


@pytest.mark.parametrize("launcher", [{}, {"RANK": "0", "WORLD_SIZE": "1"}], ids=["local", "torchrun-rank"])
def test_workers_import_the_owners_shmlearn_whatever_the_current_folder_holds(tmp_path, launcher):
    """Issue 53: from a folder holding `shmlearn/runs` (a clone's parent folder), with shmlearn installed
    as an editable install is (a meta-path finder), every forked worker died with "cannot import name
    'RunDir' from 'shmlearn.record.runs'": the forkserver put the current folder first."""
    import shmlearn
    repo = os.path.dirname(os.path.dirname(os.path.abspath(shmlearn.__file__)))
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(_FINDER.format(repo=repo))
    (boot / "program.py").write_text("from shmlearn.cli.main import entry\nentry()\n")
    here = tmp_path / "x"
    (here / "shmlearn" / "runs").mkdir(parents=True)
    env = _clean_env(PYTHONPATH=str(boot), **launcher)
    env.pop("MASTER_PORT", None)
    if launcher:
        env["MASTER_PORT"] = str(free_port())
    r = subprocess.run([sys.executable, str(boot / "program.py"), "train", "--samples", "4000", "--no-progress",
                        "--eval-points", "1", "--out", "run"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(here))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ImportError" not in r.stderr
    assert _summary(str(here / "run"))["status"] == "completed"


def test_a_ranks_default_threads_leave_out_the_cores_other_processes_keep_busy(monkeypatch):
    """Issue 53: a 1-worker run with 2 intra-op threads beside 2 busy processes on 2 cores ran 24x
    (here over 30x) slower than with --threads 1: a preempted thread holds every op's barrier."""
    from shmlearn.config import limits
    monkeypatch.setattr(limits.os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr(limits.os, "cpu_count", lambda: 4)
    load = {"avg": 2.0, "running": 3}
    monkeypatch.setattr(limits.os, "getloadavg", lambda: (load["avg"], 0.0, 0.0))
    monkeypatch.setattr(limits, "_procs_running", lambda: load["running"])
    assert limits.rank_threads("cpu", 1) == 2  # 4 cores, 2 kept busy by others
    assert limits.rank_threads("cpu", 2) == 2  # the share of each of 2 ranks
    load.update(avg=4.0, running=5)
    assert limits.rank_threads("cpu", 1) == 1  # every core contended: one thread
    load.update(avg=3.0, running=1)  # the average remembers our own earlier run; nothing runs now
    assert limits.rank_threads("cpu", 1) == 4
    load.update(avg=0.0, running=9)  # a burst of the instant, on a machine quiet for a minute
    assert limits.rank_threads("cpu", 1) == 4
    load.update(avg=4.0, running=5)
    assert limits.rank_threads("cpu", 1, threads=3) == 3  # --threads wins
    assert limits.rank_threads("cuda", 1) == 4  # a GPU rank: its own rule
    monkeypatch.setattr(limits.os, "sched_getaffinity", lambda pid: {0, 1})  # a cpuset: the host's load says nothing
    assert limits.rank_threads("cpu", 1) == 2


TWO_RUNS = """
import sys
from shmlearn import train
from shmlearn.config.train_config import TrainConfig
if __name__ == "__main__":
    hook = sys.excepthook
    for i in range(2):
        train(TrainConfig(dataset="digits", model="mlp", workers=1, samples=512, progress=False,
                          out=f"{sys.argv[1]}/r{i}"))
    assert sys.excepthook is hook, f"sys.excepthook is now {sys.excepthook!r}"
    raise RuntimeError("after two runs")
"""


def test_runs_in_this_process_leave_the_excepthook_as_they_found_it(tmp_path):
    """torch's init_process_group wraps sys.excepthook ("[rankN]: " before each line of a
    traceback) and nothing undoes it: a notebook's traceback after 13 runs carried 13 prefixes."""
    script = tmp_path / "two_runs.py"
    script.write_text(TWO_RUNS)
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    assert "RuntimeError: after two runs" in p.stderr
    assert "[rank" not in p.stderr, p.stderr
