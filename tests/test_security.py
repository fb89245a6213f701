"""Security (issue 39, docs/security.md): a local run or sweep listens on loopback only, and a
checkpoint that would run code when loaded is refused, never loaded."""
import ipaddress
import os
import subprocess
import sys
import time
import uuid

import pytest

from cli_inproc import run_main
from shmlearn.train import checkpoint as ckpt


# -- what a process tree listens on ----------------------------------------------------------------

def _tree(root):
    """root's pid and every descendant's (from /proc/<pid>/stat's parent field)."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _socket_inodes(pid):
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _address(hex_addr):
    """/proc/net/tcp{,6}'s local address ('0100007F:1F90') as (ip, port)."""
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # The kernel writes each 32-bit word in host order (little-endian here).
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw), int(port_hex, 16)


def listening(pids):
    """{(ip, port)} of the TCP sockets in LISTEN state that any of `pids` holds open."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[9]) in inodes:  # 0A: TCP_LISTEN
                found.add(_address(cols[1]))
    return found


def _loopback(ip):
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def test_listening_reads_this_process_socket():
    import socket
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert (ipaddress.ip_address("0.0.0.0"), port) in listening([os.getpid()])


def _watch(cmd, *, timeout):
    """Start `cmd`, poll what its process tree listens on until it ends (or `timeout` s): the
    completed process and every (ip, port) seen."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", SHMLEARN_TEST_TAG=uuid.uuid4().hex)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen, t0 = set(), time.monotonic()
    try:
        while p.poll() is None and time.monotonic() - t0 < timeout:
            seen |= listening(_tree(p.pid))
            time.sleep(0.1)
        out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return subprocess.CompletedProcess(cmd, p.returncode, out, err), seen


def test_a_launcher_job_store_listens_on_master_addr_only():
    """Under mpirun/srun rank 0 hosts the store on the address MASTER_ADDR names, not on every
    interface (torch's own store would bind them all)."""
    import datetime

    from shmlearn.launch import listen
    from shmlearn.launch.start import free_port
    assert listen.master_ip("127.0.0.1") == "127.0.0.1"
    assert listen.master_ip("192.0.2.1") is None  # TEST-NET-1: no address of this host
    port = free_port()
    store = listen.launcher_store("127.0.0.1", port, 0, 1, datetime.timedelta(seconds=30))
    store.set("k", "v")
    assert store.get("k") == b"v"
    mine = {(ip, p) for ip, p in listening([os.getpid()]) if p == port}
    assert mine == {(ipaddress.ip_address("127.0.0.1"), port)}, mine


SLOW = ["--dataset", "digits", "--model", "mlp", "--batch-size", "32", "--eval-points", "2", "--no-progress"]


def test_a_local_run_and_a_sweep_listen_on_loopback_only(tmp_path):
    """2 workers: the pool's store in the launcher, each rank's Gloo listener; 1 worker: the run's
    store and Gloo in the launcher's own process; a sweep: its pool's store for the whole sweep. Long enough (digits, 300 steps) to be watched on a loaded machine.
    The three are independent process trees, each watched on its own: started together (one after
    the other they spent much of their time in imports while a core was free)."""
    from concurrent.futures import ThreadPoolExecutor
    shmlearn = [sys.executable, "-m", "shmlearn"]
    cmds = {"train": shmlearn + ["train", *SLOW, "--workers", "2", "--samples", "19200", "--out", str(tmp_path / "train")],
            "alone": shmlearn + ["train", *SLOW, "--workers", "1", "--samples", "6400",  # in-process
                                 "--out", str(tmp_path / "alone")],
            "sweep": shmlearn + ["sweep", *SLOW, "--workers", "1", "--samples", "6400", "--lr", "0.05,0.1",
                                 "--no-report", "--out", str(tmp_path / "sweep")]}
    with ThreadPoolExecutor(len(cmds)) as ex:
        watched = dict(zip(cmds, ex.map(lambda cmd: _watch(cmd, timeout=600), cmds.values())))
    (train, seen_train), (alone, seen_alone), (sweep, seen_sweep) = (watched[k] for k in ("train", "alone", "sweep"))
    assert train.returncode == 0, train.stderr
    assert alone.returncode == 0, alone.stderr
    assert sweep.returncode == 0, sweep.stderr
    # Something was seen listening (the store at least), so the watch itself worked...
    assert seen_train and seen_alone and seen_sweep, (seen_train, seen_alone, seen_sweep)
    # ... and all of it on loopback.
    exposed = sorted(f"{ip}:{port}" for ip, port in seen_train | seen_alone | seen_sweep if not _loopback(ip))
    assert not exposed, f"listening beyond loopback: {exposed}"


# -- checkpoints never run code ----------------------------------------------------------------------

class _RunsCommand:
    """Pickles as a call of os.system: loading it with pickle runs the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _plant(run_dir, step, rank, marker):
    d = ckpt.step_dir(str(run_dir), step)
    os.makedirs(d, exist_ok=True)
    ckpt.write_file(os.path.join(d, f"rank{rank}.ckpt"),
                    {"step": step, "world_size": 1, "payload": _RunsCommand(f"touch {marker}")})


def test_a_checkpoint_that_would_run_code_is_refused_by_read_file(tmp_path):
    marker = tmp_path / "ran"
    _plant(tmp_path, 10, 0, marker)
    with pytest.raises(ckpt.UnsafeCheckpoint, match=r"rank0\.ckpt: refused: it needs posix\.system"):
        ckpt.read_file(os.path.join(ckpt.step_dir(str(tmp_path), 10), "rank0.ckpt"))
    assert not marker.exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path, monkeypatch, capfd, workers):
    """Planted in a run's --out and marked complete: --resume says so in one line naming the file,
    exit 2, and the command never runs. With 2 workers only rank 1's file is planted (rank 0's is
    damaged): every rank still refuses, none falls back."""
    out, marker = tmp_path / "run", tmp_path / "ran"
    _plant(out, 40, workers - 1, marker)
    if workers == 2:
        ckpt.write_file(os.path.join(ckpt.step_dir(str(out), 40), "rank0.ckpt"), {"step": 40})
        p = os.path.join(ckpt.step_dir(str(out), 40), "rank0.ckpt")
        open(p, "wb").write(open(p, "rb").read()[:40])
    ckpt.mark_complete(str(out), 40, workers)
    args = ["train", "--dataset", "digits", "--model", "mlp", "--samples", "3200", "--batch-size", "32",
            "--workers", str(workers), "--checkpoint-every", "40", "--no-progress", "--out", str(out), "--resume"]
    r = run_main(args, monkeypatch, capfd, tag=uuid.uuid4().hex)
    lines = r.stderr.strip().splitlines()
    assert not marker.exists(), "the planted checkpoint ran its command"
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"rank{workers - 1}.ckpt: refused" in lines[0] and "could run code" in lines[0], lines[0]
