"""Shared helpers for tests that watch processes (tests/ is on pytest's pythonpath)."""


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (its state in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _logged(rank, fn, log, *args):
    """fn(rank, *args) with its stdout and stderr in log.RANK: a forked process would write to
    the forkserver's, past pytest's capture."""
    import os
    fd = os.open(f"{log}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    fn(rank, *args)


def processes(fn, args, nprocs):
    """mp.spawn's processes, forked from the session's forkserver where shmlearn's own CPU
    pools would fork (tests/conftest.py; it has imported torch): spawned, each paid its ~3 s of
    imports on 2 cores before its first step. What they print is printed here, for pytest."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    from shmlearn.launch import forkserver
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "rank")
        try:
            mp.start_processes(_logged, args=(fn, log, *args), nprocs=nprocs, join=True,
                               start_method=forkserver.context(cuda=False).get_start_method())
        finally:
            for r in range(nprocs):
                if os.path.exists(f"{log}.{r}"):
                    with open(f"{log}.{r}") as f:
                        print(f.read(), end="")


def mpirun_env(env: dict) -> dict:
    """env for mpirun where neither ssh nor rsh is installed (a container): Open MPI 4 looks for
    its remote agent on PATH even to start local ranks, and stops without one ("plm_rsh_agent: ssh :
    rsh ... could not be found"); /bin/false stands in, never called for ranks on this host."""
    import shutil
    if shutil.which("ssh") or shutil.which("rsh"):
        return env
    return dict(env, OMPI_MCA_plm_rsh_agent="false")


def processes_with_tag(tag: str) -> list:
    """Process ids whose environment has SHMLEARN_TEST_TAG=tag (what a test or the fault campaign
    started, and anything those left behind), read from /proc; [] where none is left."""
    import os
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SHMLEARN_TEST_TAG={tag}".encode() in f.read():
                    found.append(int(pid))
        except OSError:  # gone meanwhile, or another user's
            pass
    return found


def left_since(before: set, pattern: str, timeout_s: float = 30.0) -> set:
    """The paths matching `pattern` that are not in `before` and are still there after up to
    timeout_s: a test's ranks must leave none (shared-memory folders), while those of tests
    running beside it under pytest-xdist come and go within their setup, so a new one is waited
    out rather than counted at once."""
    import glob
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        new = set(glob.glob(pattern)) - before
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.2)


def note_error_and_leave(out: str, rank: int, fn) -> None:
    """In a test's rank: fn(), then what it raised (its RuntimeError's line, or "no error") and the
    seconds it took in OUT/rankR.txt, then leave at once (os._exit: no interpreter teardown)."""
    import os
    import time
    t0 = time.monotonic()
    try:
        fn()
        line = "no error"
    except RuntimeError as e:
        line = str(e)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{line}\n{time.monotonic() - t0:.2f}")
    os._exit(0)
