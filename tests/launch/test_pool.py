"""The pool of long-lived workers (pool.py): pooled runs equal fresh ones bit for bit, a dead or
stopped rank is named and replaced, groups are reused per rank set, a killed launcher leaves no
orphans. Real processes, real Gloo."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from procs import alive as _alive
from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import WorkerFailed
from shmlearn.launch.pool import Pool, using
from shmlearn.train.entry import rank_main, train

SMALL = dict(dataset="digits", model="mlp", samples=1920, batch_size=16, eval_points=2, threads=1,
             progress=False, lr=0.1)


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def _assert_bitwise(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


CASES = [(w, s) for w in (1, 2, 4) for s in ("allreduce", "ps", "weight-avg", "ddp")]


@pytest.fixture(scope="module")
def pool():
    with Pool(5) as p:
        yield p


@pytest.mark.parametrize("workers,strategy", CASES)
def test_a_pooled_run_equals_a_fresh_train_bit_for_bit(pool, tmp_path, workers, strategy):
    # Batch 32, not SMALL's 16: half the steps (60, 30, 15 at 1, 2, 4 workers; weight-avg's
    # period 3 divides each), and 1920 samples still cross digits' epoch of 1437 (a reshuffle).
    extra = {"avg_period": 3} if strategy == "weight-avg" else {}
    cfg = TrainConfig(**{**SMALL, "batch_size": 32}, workers=workers, strategy=strategy, **extra)
    fresh = train(TrainConfig(**{**cfg.to_dict(), "out": str(tmp_path / "fresh")}))
    with using(pool):
        # Another trial first, on other slots and another rank set: the pool's groups and data
        # cache are then in the state a sweep leaves them in (3 steps of it do that as well as
        # the whole run did).
        train(TrainConfig(**{**cfg.to_dict(), "lr": 0.05, "samples": 3 * workers * cfg.batch_size,
                             "out": str(tmp_path / "other")}))
        pooled = train(TrainConfig(**{**cfg.to_dict(), "out": str(tmp_path / "pooled")}))
    assert fresh.model is not None and pooled.model is not None
    _assert_bitwise(fresh.model, pooled.model)
    assert _losses(fresh.run_dir) == _losses(pooled.run_dir)
    assert pooled.summary["workers"] == workers


def test_a_rank_set_keeps_its_group_and_another_gets_a_new_one(tmp_path):
    def job(tmp, lr):
        return TrainConfig(**{**SMALL, "lr": lr}, workers=2, out=str(tmp_path / tmp)).to_dict()
    with Pool(3) as p:
        a = p.start(rank_main, (job("a", 0.1),), slots=[0, 1])
        _wait(p, a)
        b = p.start(rank_main, (job("b", 0.2),), slots=[0, 1])
        _wait(p, b)
        c = p.start(rank_main, (job("c", 0.3),), slots=[1, 2])
        _wait(p, c)
        assert a.group == b.group != c.group
        assert p.started_workers == 3


def _world(env):
    import torch.distributed as dist
    return dist.get_world_size(), dist.get_rank()


def test_a_group_is_left_by_all_its_ranks_at_once(tmp_path):
    # NCCL's teardown waits for every rank: when rank 0 of a 2-rank group goes on to a 1-rank
    # job, its idle peer is told to leave at the same moment (seen on GPUs: alone, rank 0 gave up
    # after 30 s and could not build the next group). Gloo here: the same messages.
    with Pool(2) as p:
        assert _wait(p, p.start(_world, slots=[0, 1])) == [(2, 0), (2, 1)]
        assert _wait(p, p.start(_world, slots=[0, 1])) == [(2, 0), (2, 1)]
        assert p.leaves == 0  # the same rank set reuses its group: nobody leaves
        assert _wait(p, p.start(_world, slots=[0])) == [(1, 0)]
        assert p.leaves == 1 and p.workers[1].group is None
        t0 = time.monotonic()
        while p.left < 1 and time.monotonic() - t0 < 60:
            p.poll(0.2)
        assert p.left == 1
        assert _wait(p, p.start(_world, slots=[1, 0])) == [(2, 0), (2, 1)]  # a new group builds


def _wait(p, job, limit=600):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if job in p.poll(0.5):
            return job.results()
    raise AssertionError("job did not end")


def test_a_killed_worker_ends_its_job_naming_the_rank_and_the_next_runs_on_a_replacement(tmp_path):
    cfg = TrainConfig(**{**SMALL, "samples": 12800}, workers=2)
    with Pool(2) as p:
        with pytest.raises(WorkerFailed, match=r"rank 1: worker died \(killed by signal 9\)"):
            p.run(rank_main, ({**cfg.to_dict(), "out": str(tmp_path / "a")},), slots=[0, 1],
                  env={"SHMLEARN_FAULT": "kill:1:30"}, timeout_s=60)
        started = p.started_workers
        assert started >= 3  # rank 1's process replaced (rank 0's too: its group is broken)
        summary, run_dir, _ = p.run(rank_main, ({**cfg.to_dict(), "out": str(tmp_path / "b")},),
                                    slots=[0, 1], timeout_s=60)[0]
        assert summary["status"] == "completed" and summary["steps"] == 400


def _stopped_rank_0(out):
    """SIGSTOP of rank 0 once it trains; (the WorkerFailed it ended with, seconds from the stop)."""
    cfg = TrainConfig(**{**SMALL, "samples": 1_000_000, "eval_points": 1}, workers=2, timeout=8)
    with Pool(2) as p:
        job = p.start(rank_main, ({**cfg.to_dict(), "out": str(out)},), slots=[0, 1], timeout_s=8)
        t_end = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").stat().st_size < 2000:
            assert time.monotonic() < t_end and not p.poll(0.2), "the job never started training"
        os.kill(p.workers[0].proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"rank 0") as e:
            _wait(p, job, limit=120)
        return e.value, time.monotonic() - t0


def _stopped_lone_rank(out):
    """One rank that stops at step 30 (SHMLEARN_FAULT stop); (the WorkerFailed, seconds)."""
    cfg = TrainConfig(**{**SMALL, "samples": 1_000_000, "eval_points": 1}, workers=1, timeout=5)
    with Pool(1) as p:
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"rank 0: stopped responding") as e:
            p.run(rank_main, ({**cfg.to_dict(), "out": str(out)},), slots=[0], timeout_s=5,
                  env={"SHMLEARN_FAULT": "stop:0:30"})
        return e.value, time.monotonic() - t0


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The two stopped-rank cases below, each on a pool of its own, run at once in two threads:
    each spends most of its time waiting out its --timeout with the cores idle (one after the
    other they took ~25 s here). {name: future}; a test reads its own result or exception."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as ex:
        futures = {"rank0": ex.submit(_stopped_rank_0, tmp_path_factory.mktemp("stopped0") / "run"),
                   "lone": ex.submit(_stopped_lone_rank, tmp_path_factory.mktemp("lone") / "run")}
        for f in futures.values():
            f.exception()  # wait for both
    return futures


def test_a_stopped_rank_0_is_named_within_the_timeout(stopped):
    """SIGSTOP of rank 0 once it trains: its peer must not wait on a store rank 0 hosts (the
    pool hosts it), and the job ends naming rank 0, not the rank that noticed."""
    _, elapsed = stopped["rank0"].result()  # raised unless the job failed naming rank 0
    assert elapsed < 8 + 30


def test_rank_0_stopped_during_the_rendezvous_is_named_not_its_peer(tmp_path, capfd):
    """Issue 38, 9: SIGSTOP of rank 0 as the job starts, before it joins the group. Its peer's
    rendezvous times out (DistStoreError: wait timeout) and the job named that peer, rank 1:
    rank 0 had no heartbeat yet for the watchdog to miss. The pool sees rank 0's process stopped."""
    # --timeout 4: rank 0 is stopped before any collective, so no healthy wait depends on it; it is
    # only how long rank 1's rendezvous waits before it fails (8 s was idle time).
    cfg = TrainConfig(**SMALL, workers=2, timeout=4)
    with Pool(2) as p:
        p.warm()
        p.wait_ready()
        job = p.start(rank_main, ({**cfg.to_dict(), "out": str(tmp_path / "run")},), slots=[0, 1], timeout_s=4)
        os.kill(p.workers[0].proc.pid, signal.SIGSTOP)
        with pytest.raises(WorkerFailed) as e:
            _wait(p, job, limit=300)
    assert str(e.value).startswith("rank 0: stopped responding: its process is stopped"), str(e.value)
    err = capfd.readouterr().err  # the workers' stderr is this process's
    assert "socket.cpp" not in err and "TCPStore" not in err, err  # torch's C++ store warnings


def _children(pid):
    kids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p))
        except (OSError, ValueError, IndexError):
            pass
    return kids




@pytest.mark.parametrize("delay", [0.0, 1.0])
def test_a_killed_launcher_leaves_no_workers(tmp_path, delay):
    """kill -9 of `shmlearn train` at once after its workers appear (some still starting up,
    before any PR_SET_PDEATHSIG) and a second later: no worker trains on to the end."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1", SHMLEARN_TEST_TAG=uuid.uuid4().hex)
    # 1000 epochs: ~15 s of training through shared memory (40 took 0.6 s, ending before the kill)
    proc = subprocess.Popen([sys.executable, "-m", "shmlearn", "train", "--workers", "2", "--epochs", "1000",
                             "--no-progress", "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_end = time.monotonic() + 120
    kids = []
    while len(kids) < 2 and time.monotonic() < t_end:
        kids = [k for k in _children(proc.pid) if k != proc.pid]
        time.sleep(0.05)
    assert kids, "no workers started"
    time.sleep(delay)
    proc.kill()
    proc.wait()
    t_end = time.monotonic() + 60
    while any(_alive(k) for k in kids) and time.monotonic() < t_end:
        time.sleep(0.2)
    assert not any(_alive(k) for k in kids)
    assert not (out / "summary.json").exists()


def test_a_stopped_lone_rank_is_named_by_the_pool(stopped):
    """One rank, nobody waiting on it in a collective: only the pool's heartbeat watchdog can
    notice that it stopped (the campaign's sweep-trial-stopped-w1 hung before)."""
    _, elapsed = stopped["lone"].result()  # raised unless the job failed: "rank 0: stopped responding"
    assert elapsed < 120


SPAWN_MASK = r"""
import os, signal, sys
import multiprocessing.util as util
from shmlearn.launch.pool import Pool
seen = []
spawn = util.spawnv_passfds
def spy(path, args, passfds):  # what each spawned process inherits: the mask at fork
    seen.append((any("spawn_main" in os.fsdecode(a) for a in args), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    return spawn(path, args, passfds)
util.spawnv_passfds = spy
pool = Pool(2)
pool.warm()
pool.close()
print(seen, signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
"""


def test_every_worker_starts_with_ctrl_c_blocked_also_the_one_that_starts_the_resource_tracker():
    """Issue 38, 8: a worker's interpreter starts with SIGINT blocked (Ctrl-C in its imports is no
    traceback). multiprocessing starts its resource tracker on the first spawn, with SIGINT blocked
    and then UNBLOCKED, which undid Pool._spawn's block: the first worker started with Ctrl-C live
    (CI: one KeyboardInterrupt traceback from spawn_main). A fresh interpreter: no tracker yet."""
    # spawned workers (SHMLEARN_FORKSERVER=0): a pool of `python -c` would start the forkserver,
    # whose forks start with its mask (tests/launch/test_pool_forkserver.py)
    r = subprocess.run([sys.executable, "-c", SPAWN_MASK], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), SHMLEARN_FORKSERVER="0"))
    assert r.returncode == 0, r.stderr
    seen, after = eval(r.stdout.strip().rsplit("] ", 1)[0] + "]"), r.stdout.strip().endswith("False")
    workers = [blocked for is_worker, blocked in seen if is_worker]
    assert len(workers) == 2 and all(workers), r.stdout
    assert after, r.stdout  # the caller's own mask is as it was


@pytest.mark.parametrize("world", [1, 2])
def test_an_nccl_group_of_one_is_built_lazily(monkeypatch, world):
    """A pool's 1-worker job joins its NCCL group without `device_id`, so NCCL builds no
    communicator (0.45-0.5 s a GPU process on an H200) for a run that makes no collective; a
    group of two or more is built at the join, where a peer's failure shows."""
    import torch
    import torch.distributed as dist

    from shmlearn.launch import worker
    joined = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: joined.setdefault("device", d))
    monkeypatch.setattr(worker, "_gpu_of", lambda task: 0)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.update(backend=backend, **kw))
    task = worker.Task(job=1, fn=print, args=(), rank=0, world=world, slots=tuple(range(world)), group=1,
                       backend="nccl", timeout_s=5.0)
    worker._join_group(task, dist.HashStore())
    assert joined["backend"] == "nccl" and joined["world_size"] == world and joined["device"] == torch.device("cuda", 0)
    assert ("device_id" in joined) == (world > 1), joined


SEMAPHORE = """
import multiprocessing as mp, os, sys
from multiprocessing import resource_tracker
mp.set_start_method("forkserver")  # a pool worker's, as the forkserver's fork sets it: its locks are named
resource_tracker.ensure_running()
lock = mp.RLock()  # what tqdm makes class-wide once Inductor shows its compile progress in a worker
from shmlearn.launch.worker import release_semaphores
if sys.argv[1] == "release":
    release_semaphores()
sys.stdout.flush()
os._exit(0)  # as a pool worker leaves
"""


def test_a_worker_leaving_by_os_exit_releases_its_semaphores():
    """A compiled CPU run ended with the resource tracker's "There appear to be 2 leaked semaphore
    objects" after its last line: its workers leave by os._exit, which skips the finalizers that
    unlink multiprocessing's locks. release_semaphores runs those (and only those) first."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    runs = {how: subprocess.run([sys.executable, "-c", SEMAPHORE, how], capture_output=True, text=True,
                                timeout=120, env=env) for how in ("release", "leave")}
    assert all(r.returncode == 0 for r in runs.values()), {k: r.stderr for k, r in runs.items()}
    assert "leaked semaphore" not in runs["release"].stderr, runs["release"].stderr
    assert "leaked semaphore" in runs["leave"].stderr  # what the test guards against does happen


def test_stop_lets_idle_workers_leave_without_waiting_and_close_reaps_them():
    """Pool.stop (a sweep's, once its trials are recorded): each idle worker is told to leave and
    does, after leaving its group, while the owner goes on; no job starts after it; close() then
    reaps the processes (and is the only wait)."""
    p = Pool(2)
    try:
        assert p.run(_world, slots=range(2)) == [(2, 0), (2, 1)]  # both hold a 2-rank Gloo group
        procs = [w.proc for w in p.workers.values()]
        t0 = time.monotonic()
        p.stop()
        assert time.monotonic() - t0 < 1.0  # no join here
        with pytest.raises(ValueError, match="stopped"):
            p.start(_world, slots=range(2))
        for proc in procs:  # they leave on their own (a loaded 2-core machine: allow time)
            proc.join(60)
            assert proc.exitcode == 0
    finally:
        p.close()
    assert not p.workers
