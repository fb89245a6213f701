"""The program's CPU workers fork from a forkserver that imported torch once (shmlearn/launch/forkserver.py,
issue 41's start-up), and are still what a spawned worker was: the owner's environment, Ctrl-C
ignored, a seed of their own, dead with their owner; GPU pools fork too, an owner that
initialized CUDA spawns."""
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from procs import alive as _alive
from shmlearn.cli import main as cli
from shmlearn.config import limits
from shmlearn.launch import forkserver

PROBE = r"""
import json, os, signal, sys, time
from shmlearn.launch import forkserver
from shmlearn.launch.pool import Pool


def probe(env):
    import numpy
    return {"pid": os.getpid(), "ppid": os.getppid(), "var": os.environ.get("SHMLEARN_TEST_VAR"),
            "sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
            "blocked": signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []),
            "seed": int(numpy.random.randint(1 << 30)), "parent_blocks_sigint": _blocks_sigint(os.getppid())}


def _blocks_sigint(pid):  # what a fork of it starts with
    with open(f"/proc/{pid}/status") as f:
        blk = next(line for line in f if line.startswith("SigBlk:"))
    return bool(int(blk.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def sleep(env):
    import time
    time.sleep(600)


if __name__ == "__main__":
    assert forkserver.start()
    os.environ["SHMLEARN_TEST_VAR"] = "set after the forkserver started"
    pool = Pool(2)
    seen = pool.run(probe, slots=[0, 1], backend=None)
    print(json.dumps({"owner": os.getpid(), "workers": seen}), flush=True)
    if sys.argv[1:] == ["die"]:  # the owner dies while its workers are busy (idle ones see the pipe close)
        pool.start(sleep, slots=[0, 1], backend=None)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    pool.close()
"""


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe_fs.py"
    path.write_text(PROBE)
    return path


def _run(path, *args, **kw):
    return subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), **kw)


def test_forked_workers_are_what_spawned_ones_were(probe):
    p = _run(probe)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    w = seen["workers"]
    assert all(x["ppid"] != seen["owner"] for x in w)  # forks of the forkserver, not spawned by the owner
    assert w[0]["ppid"] == w[1]["ppid"]
    assert all(x["var"] == "set after the forkserver started" for x in w)  # the owner's environment
    assert all(x["parent_blocks_sigint"] for x in w)  # so a fork starts with Ctrl-C blocked
    assert all(x["sigint"] and not x["blocked"] for x in w)  # then ignored, as _worker_main sets
    assert w[0]["seed"] != w[1]["seed"]  # numpy's global seed drawn in each, as a spawn does
    assert "Traceback" not in err, err




def test_forked_workers_die_with_their_owner(probe):
    """Their parent is the forkserver, so PR_SET_PDEATHSIG cannot name the owner: the pidfd watch does."""
    p = _run(probe, "die")
    pids = [x["pid"] for x in json.loads(p.stdout.readline())["workers"]]
    try:
        assert p.wait(timeout=300) == -9
        t_end = time.monotonic() + 30
        while any(_alive(x) for x in pids) and time.monotonic() < t_end:
            time.sleep(0.2)
        assert not any(_alive(x) for x in pids)
    finally:
        for x in filter(_alive, pids):  # the orphans of a failure
            os.kill(x, 9)


def test_the_forkserver_for_owners_without_cuda_and_an_unchanged_import_environment(monkeypatch):
    monkeypatch.setattr(forkserver, "_started_env", None)
    monkeypatch.setenv("SHMLEARN_FORKSERVER", "0")
    assert forkserver.context(False) is mp.get_context("spawn")  # turned off: spawn, as before
    assert forkserver._started_env is None
    monkeypatch.delenv("SHMLEARN_FORKSERVER")
    assert forkserver.context(False) is mp.get_context("forkserver")  # not started: the first pool starts it
    assert forkserver._started_env == forkserver._import_env()
    assert forkserver.context(False) is mp.get_context("forkserver")
    assert forkserver.context(True) is mp.get_context("forkserver")  # a GPU pool: its forks initialize CUDA
    monkeypatch.setattr(forkserver, "_cuda_initialized", lambda: True)
    assert forkserver.context(False) is mp.get_context("spawn")  # CUDA initialized in the owner
    assert forkserver.context(True) is mp.get_context("spawn")
    monkeypatch.setattr(forkserver, "_cuda_initialized", lambda: False)
    # Inductor sets its cache folder's variable at its first compile; it is read when used
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/somewhere-else")
    assert forkserver.context(False) is mp.get_context("forkserver")
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1" if os.environ.get("TORCH_SHOW_CPP_STACKTRACES") != "1" else "0")
    assert forkserver.context(False) is mp.get_context("spawn")  # torch would have imported otherwise


@pytest.mark.parametrize("argv,started", [
    # a CPU train that compiles nothing is lean (no torch._dynamo): 2 workers on these 2 cores fork
    # from it, none needed; 1 worker of 2 threads on them needs one without Dynamo; compiling: as before
    (["train", "--workers", "2"], False), (["train"], False), (["train", "--workers", "1"], False),
    (["train", "--help"], False), (["train", "--device", "cpu"], False),
    (["train", "--threads", "2"], "lean"), (["train", "--compile", "default"], True),
    (["train", "--config", "r.yaml"], True), (["experiment", "run", "cnn"], False),
    (["experiment", "run", "cnn", "--axis", "compile=default"], True),
    (["experiment", "list"], False), (["sweep", "--help"], False), (["report", "runs/x"], False),
    # a CPU sweep that compiles nothing, a thread a rank: its lean workers fork from it, none needed
    (["sweep", "--workers", "2"], False), (["sweep", "--workers", "1"], False), (["sweep", "--compile", "off"], False),
    # ... with 2 threads a rank, or a study: one without torch._dynamo; compiling, or a YAML that may: as train's
    (["sweep", "--threads", "2"], "lean"), (["sweep", "--storage", "sqlite:///s.db"], "lean"),
    (["sweep", "--compile", "default"], True),
    (["sweep", "--config", "s.yaml"], True)])
def test_the_program_starts_it_early_for_local_cpu_pools_only(monkeypatch, argv, started):
    """started: True (torch and torch._dynamo preloaded), "lean" (torch alone) or False."""
    calls = []
    monkeypatch.setattr(forkserver, "start", lambda dynamo=True: calls.append(True if dynamo else "lean"))
    monkeypatch.setattr(limits, "usable_cores", lambda: 2)  # this machine's cores, on any machine
    monkeypatch.setattr(os.path, "exists", lambda p: False)  # no GPU driver
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # and none visible
    cli.prestart(argv)
    assert (calls[0] if calls else False) == started and len(calls) <= 1
    calls.clear()
    monkeypatch.setenv("RANK", "0")  # under torchrun: this process is a rank, no pool
    monkeypatch.setenv("WORLD_SIZE", "2")
    cli.prestart(argv)
    assert not calls


@pytest.mark.parametrize("argv,visible,started", [
    (["train"], "0", None),                          # one GPU: the run is this process's own
    (["train"], "0,1", "lean"),                      # two: a pool of two GPU workers forks from it,
    (["train", "--workers", "2"], "0", "lean"),      # or asked for (Gloo shares the GPU); nothing compiles
    (["train", "--compile", "default"], "0,1", "dynamo"), (["train", "--config", "r.yaml"], "0,1", "dynamo"),
    (["train", "--device", "cpu"], "0", None),       # the CPU's default of 2 workers, lean: they fork from it
    (["sweep"], "0", "lean"), (["experiment", "run", "alexnet-sweep", "--device", "cuda"], "0,1,2,3", "lean"),
    (["experiment", "run", "alexnet-sweep", "--axis=compile=default"], "0,1,2,3", "dynamo"),
    (["sweep", "--compile", "default"], "0", "dynamo"),
    (["sweep", "--device", "cpu"], "0", None)])      # a CPU sweep's lean workers fork from it
def test_on_a_gpu_host_it_starts_for_pools_and_not_for_a_run_of_one_gpu(monkeypatch, argv, visible, started):
    """started: "dynamo" (torch and torch._dynamo preloaded), "lean" (torch alone: no trial or
    rank compiles) or None (no forkserver)."""
    monkeypatch.setattr(limits, "usable_cores", lambda: 2)
    calls = []
    monkeypatch.setattr(forkserver, "start", lambda dynamo=True: calls.append("dynamo" if dynamo else "lean"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cli.prestart(argv)
    assert calls == ([started] if started else [])


def test_visible_gpus_reads_cuda_visible_devices_else_the_driver(monkeypatch):
    for value, n in (("", 0), ("0", 1), ("0,1,3", 3), ("-1", 0), ("GPU-5d1f,GPU-77aa", 2)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert cli._visible_gpus() == n, value
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(os, "listdir", lambda d: ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"])
    assert cli._visible_gpus() == 2


def test_a_command_that_ends_before_the_forkserver_imported_does_not_leave_it_holding_its_pipes():
    """A refusal found after start() (a bad flag, once torch is imported): the forkserver is ended
    at exit, not left importing torch for seconds with the command's stdout (`| tail` waited)."""
    script = ("from multiprocessing import forkserver as f; from shmlearn.launch import forkserver; forkserver.start(); "
              "print(f._forkserver._forkserver_pid, flush=True)")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    pid = int(p.stdout.readline())
    assert p.wait(timeout=60) == 0
    t_end = time.monotonic() + 1.0  # its imports of torch and torch._dynamo take several seconds
    while _alive(pid) and time.monotonic() < t_end:
        time.sleep(0.05)
    assert not _alive(pid)
    assert p.stdout.read() == ""  # and the pipe is closed: read() returned


def test_an_owner_killed_while_the_forkserver_imports_torch_does_not_leave_it_importing():
    """kill -9 of the program (the fault campaign's kill-launcher cases, 0.5-1.5 s after start):
    the forkserver, the owner's child, dies with it (PR_SET_PDEATHSIG, set by its first import)
    instead of importing torch and torch._dynamo for seconds with no owner to serve."""
    script = ("import os, signal; from multiprocessing import forkserver as f; from shmlearn.launch import forkserver; "
              "forkserver.start(); print(f._forkserver._forkserver_pid, flush=True); "
              "os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    pid = int(p.stdout.readline())
    try:
        assert p.wait(timeout=60) == -9
        t_end = time.monotonic() + 1.0  # its imports take several seconds
        while _alive(pid) and time.monotonic() < t_end:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, 9)


SCRIPT = r"""
import json, os, sys
import shmlearn                      # a script's import starts the forkserver (forkserver.autostart)
from multiprocessing import forkserver as mpf
from shmlearn.launch import forkserver


def where(env):
    return os.getppid()


if __name__ == "__main__":
    started = forkserver._started_env is not None
    server = getattr(mpf._forkserver, "_forkserver_pid", None)
    parents = []
    if started and sys.argv[1:] == ["train"]:
        from shmlearn.launch.pool import Pool
        with Pool(2) as pool:
            parents = pool.run(where, slots=[0, 1], backend=None)
        r = shmlearn.train(shmlearn.TrainConfig(workers=2, samples=640, device="cpu", progress=False,
                                                out=sys.argv[0] + ".run"))
        assert r.status == "completed", r.status
    print(json.dumps({"started": started, "server": server, "parents": parents}), flush=True)
"""


@pytest.mark.parametrize("env,args,started", [
    ({}, ["train"], True),                                   # a script: on, its workers are the forkserver's forks
    ({"SHMLEARN_FORKSERVER": "0"}, [], False),               # turned off
    ({"RANK": "0", "WORLD_SIZE": "1"}, [], False),           # a launcher's rank starts no pool
], ids=["script", "off", "launcher-rank"])
def test_a_scripts_import_starts_the_forkserver_its_workers_fork_from(tmp_path, env, args, started):
    path = tmp_path / "script_fs.py"
    path.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=300,
                       env=dict(base, PYTHONPATH=os.pathsep.join(sys.path), **env))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["started"] is started
    if started:
        assert out["parents"] == [out["server"], out["server"]]


def test_an_interactive_or_dash_c_session_starts_no_forkserver():
    code = "import shmlearn; from shmlearn.launch import forkserver; print(forkserver._started_env is None)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.stdout.strip() == "True", r.stderr
