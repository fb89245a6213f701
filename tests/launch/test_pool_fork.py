"""Workers forked from the caller itself (forkserver.caller_fork, issue 51/52's start-up): where a
pool's ranks run one intra-op thread each and the caller has imported torch._dynamo, train()'s
workers are forks of the process that called it: what the script defined, even under its main
guard, is there, and the script is not run again. Still what a spawned worker was (Ctrl-C ignored,
the default handlers, a numpy seed of its own, dead with the owner, output where the owner's goes),
and never hung by the caller's libgomp team."""
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from procs import alive as _alive
from shmlearn.config.limits import usable_cores
from shmlearn.launch import forkserver
from shmlearn.launch.pool import Pool

SCRIPT = r"""
import json, os, signal, sys
import torch, torch._dynamo          # the caller imported it (its first optimizer does)
import shmlearn
from shmlearn.launch.pool import Pool

COUNT = [0]
COUNT[0] += 1                         # how many times this file ran in this process


def probe(env):
    import numpy
    x = torch.randn(512, 2048)        # a parallel op (64 grains): a team of 2+ threads would hang
    return {"pid": os.getpid(), "ppid": os.getppid(), "ran": COUNT[0], "guarded": globals().get("GUARDED"),
            "threads": torch.get_num_threads(), "sum": float(x.exp().sum()),
            "sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
            "sighup": signal.getsignal(signal.SIGHUP) == signal.SIG_DFL,
            "seed": int(numpy.random.randint(1 << 30))}


def sleep(env):
    import time
    time.sleep(600)


if __name__ == "__main__":
    GUARDED = "defined under the main guard"
    signal.signal(signal.SIGHUP, lambda *a: None)   # the program installs its own (cli/exits.py)
    torch.set_num_threads(2)
    torch.randn(4096, 4096).exp_()    # the caller's libgomp team exists from here on (2+ cores)
    with Pool(2, one_thread=True) as pool:
        seen = pool.run(probe, slots=[0, 1], backend=None)
        print(json.dumps({"owner": os.getpid(), "workers": seen, "startup": pool.startup,
                          "threads": torch.get_num_threads()}), flush=True)
        if sys.argv[1:] == ["die"]:
            pool.start(sleep, slots=[0, 1], backend=None)
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe_fork.py"
    path.write_text(SCRIPT.replace("time.sleep(1)", "__import__('time').sleep(1)"))
    return path


def _run(path, *args):
    return subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
                            start_new_session=True)


def _communicate(p, timeout=300):
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # a hung worker (the libgomp case) must not outlive the test
        out, err = p.communicate()
        pytest.fail(f"timed out after {timeout} s: {out[-2000:]} {err[-2000:]}")


def test_workers_fork_from_the_caller_and_do_not_run_its_script_again(script):
    out, err = _communicate(_run(script))
    assert "Traceback" not in err, err
    seen = json.loads(out.strip().splitlines()[-1])
    w = seen["workers"]
    assert [s["start"] for s in seen["startup"]] == ["fork", "fork"], seen["startup"]
    assert all(x["ppid"] == seen["owner"] for x in w)  # children of the caller, not of the forkserver
    assert all(x["guarded"] == "defined under the main guard" for x in w)  # the caller's objects
    assert all(x["ran"] == 1 for x in w)  # the script ran once, in the caller: no rerun in the worker
    # One intra-op thread, set before the first op: the caller's team of 2 is not the fork's. The
    # parallel op completed (else: timeout), and gave torch's own answer.
    assert all(x["threads"] == 1 for x in w)
    assert seen["threads"] == 2  # the caller keeps its own
    assert all(x["sigint"] and x["sighup"] for x in w)  # Ctrl-C ignored; the caller's handlers are not theirs
    assert w[0]["seed"] != w[1]["seed"]  # numpy's global seed drawn in each, as a spawn does


def test_a_fork_of_the_caller_dies_with_it(script):
    p = _run(script, "die")
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


GOMP = r"""
import os, signal, sys, torch
torch.set_num_threads(2)
torch.randn(4096, 4096).exp_()        # the caller's libgomp team of 2
pid = os.fork()
if pid == 0:
    torch.set_num_threads(int(sys.argv[1]))
    torch.randn(4096, 4096).exp_()
    os._exit(0)
import time
t_end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < t_end:
    if os.waitpid(pid, os.WNOHANG)[0]:
        print("done"); sys.exit(0)
    time.sleep(0.05)
os.kill(pid, signal.SIGKILL)
print("hung")
"""


@pytest.mark.skipif(usable_cores() < 2, reason="a libgomp team needs 2+ cores")
def test_why_one_thread_the_fork_of_a_caller_with_a_thread_team_hangs_with_two(tmp_path):
    """The rule caller_fork keeps: the same fork with 2 threads waits for the caller's team forever
    (here 20 s), with 1 it completes. The two programs run at once: the one with 1 thread
    completes inside the other's 20 s of waiting (CPU idle)."""
    path = tmp_path / "gomp.py"
    path.write_text(GOMP)
    procs = [subprocess.Popen([sys.executable, str(path), str(n), "20"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (1, 2)]
    try:
        run = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [out.strip() for out, _ in run] == ["done", "hung"], [err for _, err in run]


def _dynamo():
    """What the caller's first optimizer imports (caller_fork asks for it)."""
    importlib.import_module("torch._dynamo")


def test_caller_fork_only_where_safe(monkeypatch):
    _dynamo()
    if threading.active_count() > 1:
        pytest.skip("this test process runs other threads (pytest-xdist)")
    monkeypatch.delenv("SHMLEARN_FORKSERVER", raising=False)
    assert forkserver.caller_fork(True) is None
    assert "intra-op" in forkserver.caller_fork(False)
    monkeypatch.setenv("SHMLEARN_FORKSERVER", "0")
    assert forkserver.caller_fork(True) == "SHMLEARN_FORKSERVER=0"
    monkeypatch.delenv("SHMLEARN_FORKSERVER")
    monkeypatch.setattr(forkserver, "_cuda_initialized", lambda: True)
    assert "CUDA" in forkserver.caller_fork(True)
    monkeypatch.setattr(forkserver, "_cuda_initialized", lambda: False)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert "threads" in forkserver.caller_fork(True)
    finally:
        stop.set()
        t.join()
    monkeypatch.delitem(sys.modules, "torch._dynamo")
    assert "torch._dynamo" in forkserver.caller_fork(True)


def test_caller_fork_refused_in_a_process_group(monkeypatch):
    _dynamo()
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert "process group" in forkserver.caller_fork(True)


def _say(env, text):
    print(f"{text} from rank {env.rank}", flush=True)
    return torch.get_num_threads()


def test_a_fork_of_the_caller_writes_where_the_callers_output_goes(capfd, monkeypatch):
    """pytest's capture (fds 1 and 2) sees a forked worker's output, as it sees a spawned one's."""
    _dynamo()
    monkeypatch.delenv("SHMLEARN_FORKSERVER", raising=False)
    why = forkserver.caller_fork(True)
    if why is not None:
        pytest.skip(f"no fork of the caller here: {why}")
    with Pool(2, one_thread=True) as pool:
        threads = pool.run(_say, ("hello",), slots=[0, 1], backend=None)
        starts = [s["start"] for s in pool.startup]
    assert starts == ["fork", "fork"]
    assert threads == [1, 1]
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_a_pool_of_several_thread_ranks_does_not_fork_the_caller():
    _dynamo()
    with Pool(1) as pool:  # one_thread False: a rank may run 2+ threads
        pool.run(_say, ("hi",), slots=[0], backend=None)
        assert pool.startup[0]["start"] in ("forkserver", "spawn")
        assert "intra-op" in pool.startup[0]["why_not_fork"]


IDLE = r"""
import json, os, sys
import torch, torch._dynamo
import shmlearn                       # a script's import starts the forkserver (forkserver.autostart)
from multiprocessing import forkserver as mpf
from shmlearn.launch import forkserver
from shmlearn.launch.pool import Pool


def where(env):
    return os.getppid()


if __name__ == "__main__":
    first = mpf._forkserver._forkserver_pid
    with Pool(2, one_thread=True) as pool:   # forks of this process: the forkserver is not needed
        forked = pool.run(where, slots=[0, 1], backend=None)
    gone = not os.path.exists(f"/proc/{first}") and forkserver._started_env is None
    with Pool(1) as pool:                    # a pool that needs it starts it again
        again = pool.run(where, slots=[0], backend=None)
    print(json.dumps({"owner": os.getpid(), "first": first, "forked": forked, "gone": gone, "again": again,
                      "second": mpf._forkserver._forkserver_pid}), flush=True)
"""


def test_an_unused_forkserver_is_stopped_when_the_workers_fork_from_the_caller(tmp_path):
    """It would import torch beside the workers (a script that imported torch before shmlearn starts
    it late); a later pool that needs one starts it again."""
    path = tmp_path / "idle.py"
    path.write_text(IDLE)
    out, err = _communicate(_run(path))
    assert "Traceback" not in err, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["first"] and seen["gone"], seen
    assert seen["forked"] == [seen["owner"]] * 2
    assert seen["second"] not in (None, seen["first"]) and seen["again"] == [seen["second"]], seen
