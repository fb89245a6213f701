"""The collectives of a CPU run's ranks on one host through shared memory (--shared-memory auto):
the gradient or weight average, the fast step's read of the losses, and the parameter server's
gather and broadcast, in place of Gloo's over loopback TCP.

Why: Gloo's all-reduce of a small buffer between local processes is a round of TCP messages
through its own threads; on a 2-core machine the 203 KB gradient of the digits MLP took 0.9 ms
median and 1.7 ms mean a step (p90 4 ms) between two ranks, against 0.1-0.24 ms here, and 6.9 ms
against 1.0 ms between four (docs/performance.md, "The CPU's gradient average"). MPI does the same
between the ranks of one node (its shared-memory transport); torch's Gloo has none.

How:
* One file on a RAM-backed file system (/dev/shm; else the temporary folder) holds two sets of
  `world` slots of the buffer's size: step k uses set k % 2. Rank 0 makes it and reserves its
  pages up front (posix_fallocate: a full /dev/shm is a note and Gloo, never a SIGBUS later),
  every rank maps it (torch.from_file, shared), and rank 0 unlinks it once all have: nothing is
  left behind, however the run ends (a rank 0 killed in the moments before is swept up by
  the next run's: `_sweep_stale`).
* A step: each rank copies its buffer into its slot, tells every other rank (one byte, its rank,
  into that rank's FIFO), waits until every other rank has told it, then sums the slots in rank
  order into its buffer. Every rank sums the same slots in the same order with the same kernels,
  so the replicas stay bit-identical; between two ranks the sum is Gloo's to the bit (a + b = b + a).
  A large sum among 3+ ranks is split (`_sum_split`): each rank sums one W-th of every slot, in
  rank order, and the others copy it after a second signal: the same bits, W times less reading.
* One signal an op suffices: the op after next writes the same set of slots, and a rank's signal
  of the next op says it has finished reading this one (`_owed`: whose word a rank needs before it
  writes a set again; a caller's sequence that would write without it is refused, never raced). A
  sum waits for every rank; a gather (the parameter server's) has the root wait for the others,
  and the broadcast that follows has them wait for the root: alternated, each op hears from the
  readers of the one before. A signal that arrives early (a rank already in a later op) is kept
  for that op (`_credit`). The pipe's write and read order the slot's writes before its reads.
* A rank that dies or hangs: the wait polls, and every second checks that the other ranks' processes
  still exist; one gone is this rank's error naming it, and the --timeout bounds the wait, as
  Gloo's does.

Where (`open_collectives`, agreed by every rank in one all-reduce, else Gloo): CPU float buffers (the
gradient or the weights, and the fast step's read of the losses: any float dtype), a Gloo group
of 2-255 ranks, every rank on this host (the same boot id and host name, and each sees
the others' processes), the mapping fits (2 x world x the buffer, at most MAX_BYTES) and the file
system has room. async-ps's messages take the same channel's pieces (`ShmChannel`, `open_collectives`
with `make`: sync/shm_mailbox.py).
"""
from __future__ import annotations

import os
import select
import shutil
import socket
import tempfile
import time
from typing import List, Optional, Tuple, Type

import torch
import torch.distributed as dist

from shmlearn.errors import count

MAX_BYTES = 4 << 30
"""The largest mapping (2 x world x buffer) this path takes; a bigger one uses Gloo."""
READ_BYTES = 64 << 10
"""The slots hold at least this much: the fast step's read of the losses (float64, a rank's losses
since the last read and three requests) fits for reads up to ~8,000 steps apart at one rank,
~2,000 at four."""
MAX_WORLD = 255
"""A signal is one byte: the sender's rank."""
CHECK_S = 1.0
"""How often a waiting rank checks that the others' processes are still there."""
CHUNK_BYTES = 4 << 20
"""A sum of at least this many bytes among at least SPLIT_WORLD ranks is split
(`ShmCollectives._sum_split`): each rank sums one W-th of the slots and the others copy it,
instead of every rank summing all of them. Below either, the second round's signals cost more
than the reads they save (bench comm on 2 cores: at 2 ranks no gain at any size; at 3-4 ranks
1.2-1.3x from 4 MB, none at 1 MB; docs/scaling.md, "Shared memory on the CPU")."""
SPLIT_WORLD = 3
ALIGN = 64
"""Chunk boundaries of a split sum fall on multiples of this many bytes (a cache line)."""


def _host() -> str:
    """This host's identity: its boot id (distinct per boot, per machine) and name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{boot}/{socket.gethostname()}"


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ShmChannel:
    """What every shared-memory channel between one host's ranks holds (sync/shm.py's collectives,
    sync/shm_mailbox.py's messages): the mapped slots, a FIFO to read this rank's one-byte signals
    from (each byte a sender's rank, in the order sent) and one to each other rank's, and the wait
    that names a rank gone or silent past the --timeout."""

    what = "shared-memory collectives"
    """How errors name the channel."""

    def __init__(self, slots: torch.Tensor, rank: int, world: int, read_fd: int, write_fds: List[Optional[int]],
                 pids: List[int], timeout_s: float):
        self.slots = slots  # [2, world, capacity in bytes] (uint8; each row starts 8-byte aligned)
        self.rank, self.world = rank, world
        self.read_fd, self.write_fds = read_fd, write_fds
        self.pids = pids
        self.timeout_s = timeout_s
        self._me = bytes([rank])
        self._poll = select.poll()
        self._poll.register(read_fd, select.POLLIN)
        self._next_check = time.monotonic() + CHECK_S

    def _signal(self, ranks) -> None:
        for r in ranks:
            try:
                os.write(self.write_fds[r], self._me)
            except BrokenPipeError:  # its reading end is gone with it
                raise RuntimeError(f"{self.what}: rank {r} ended") from None

    def _signals(self, missing: set, deadline: float) -> bytes:
        """The signals that have come (their senders' ranks, in order), waiting at most until the
        next check: b'' if none. At least once a second, however many signals come, a rank of
        `missing` whose process is gone, or the deadline passed, is this rank's error naming it."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + CHECK_S
            self._check(missing, deadline)
        # poll, not select: select refuses descriptors from 1024 up, and a worker forked from a
        # long-lived caller (a notebook, a test session) inherits hundreds of them
        if not self._poll.poll(max(1, int((self._next_check - now) * 1000))):
            return b""
        data = os.read(self.read_fd, 4096)
        if not data:  # every writer's end closed: the other ranks are gone
            raise RuntimeError(f"{self.what}: rank {min(missing)} ended")
        return data

    def _check(self, missing: set, deadline: float) -> None:
        for r in sorted(missing):
            try:
                os.kill(self.pids[r], 0)
            except ProcessLookupError:
                raise RuntimeError(f"{self.what}: rank {r} ended (process {self.pids[r]})") from None
            except PermissionError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{self.what}: no word from rank {min(missing)} in "
                               f"{self.timeout_s:g} s (--timeout)")

    def close(self) -> None:
        for fd in [self.read_fd, *self.write_fds]:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.write_fds = []


class ShmCollectives(ShmChannel):
    """The collectives of one host's CPU ranks through shared memory (module docstring): a sum
    in rank order (`sum_`), a gather to one rank (`gather`) and a broadcast from it (`broadcast_`)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.step = 0
        self._credit = [0] * self.world  # signals of a rank's next step, read early
        self._owed: List[set] = [set(), set()]  # by parity: ranks that may still read what we wrote there
        self._others = [r for r in range(self.world) if r != self.rank]

    def fits(self, buf: torch.Tensor) -> bool:
        """Whether the collectives take this buffer: a contiguous CPU float tensor of at most the capacity."""
        return (buf.device.type == "cpu" and buf.is_floating_point() and buf.is_contiguous()
                and buf.numel() * buf.element_size() <= self.slots.shape[-1])

    def _next(self, buf: torch.Tensor, writes: bool = True) -> tuple:
        """This op's slots, [world, n] of buf's dtype, and their parity; refuses (a protocol error
        of the caller's) to write where a rank may still read what this rank wrote two ops ago."""
        parity = self.step & 1
        self.step += 1
        if writes and self._owed[parity]:
            raise RuntimeError(f"shared-memory collectives: rank {self.rank} would overwrite what rank "
                               f"{min(self._owed[parity])} may still read (two ops without word from it)")
        n = buf.numel() * buf.element_size()
        return self.slots[parity, :, :n].view(buf.dtype), parity

    def sum_(self, buf: torch.Tensor) -> None:
        """buf <- the sum of buf over the ranks, in rank order; every rank calls it in step, with
        a buffer of the same size and dtype (`fits`)."""
        if self.world >= SPLIT_WORLD and buf.numel() * buf.element_size() >= CHUNK_BYTES:
            return self._sum_split(buf)
        slots, parity = self._next(buf)
        slots[self.rank].copy_(buf.view(-1))
        self._signal(self._others)
        self._wait(self._others)
        self._owed[parity] = set(self._others)  # they read our row after this op's signal
        out = buf.view(-1)
        out.copy_(slots[0])
        for r in range(1, self.world):
            out.add_(slots[r])

    def _sum_split(self, buf: torch.Tensor) -> None:
        """sum_ of a large buffer in two rounds, as a reduce-scatter and an all-gather: every rank
        copies its buffer into its slot and signals; each then sums its own W-th (`_chunks`) of
        every slot in rank order, writes it over the same W-th of its own slot (no other rank
        reads that part of it in the first round) and signals again; each copies the others'
        W-ths. The same adds of the same values as sum_'s one round, so the same bits; each rank
        reads every slot's W-th rather than every slot: where W ranks each summed all W slots,
        the reads grew as W^2 (4 ranks on 2 cores, 16-64 MB: 1.1x Gloo's ring in one round,
        1.5-1.7x split; docs/scaling.md, "Shared memory on the CPU")."""
        slots, parity = self._next(buf)
        flat = buf.view(-1)
        slots[self.rank].copy_(flat)
        self._signal(self._others)
        self._wait(self._others)
        chunks = self._chunks(flat.numel(), flat.element_size())
        a, b = chunks[self.rank]
        mine = flat[a:b]
        mine.copy_(slots[0, a:b])
        for r in range(1, self.world):
            mine.add_(slots[r, a:b])
        slots[self.rank, a:b].copy_(mine)
        self._signal(self._others)
        self._wait(self._others)
        self._owed[parity] = set(self._others)  # they read our W-th after this op's second signal
        for r in self._others:
            a, b = chunks[r]
            flat[a:b].copy_(slots[r, a:b])

    def _chunks(self, n: int, itemsize: int) -> List[Tuple[int, int]]:
        """Rank r's part [a, b) of n elements: consecutive W-ths, bounds on ALIGN bytes, the last
        to the end (a part may be empty where n is small)."""
        step = -(-n // self.world)
        unit = max(1, ALIGN // itemsize)
        step = -(-step // unit) * unit
        return [(min(n, r * step), min(n, (r + 1) * step)) for r in range(self.world)]

    def gather(self, buf: torch.Tensor, root: int = 0) -> Optional[torch.Tensor]:
        """Every rank's buf, on `root` as the rows of a [world, n] view of the slots (valid until
        its next op); None on the others, which do not wait."""
        slots, parity = self._next(buf)
        slots[self.rank].copy_(buf.view(-1))
        if self.rank != root:
            self._signal([root])
            self._owed[parity] = {root}
            return None
        self._wait(self._others)
        return slots

    def broadcast_(self, buf: torch.Tensor, root: int = 0) -> None:
        """buf <- root's buf on every rank; root does not wait."""
        slots, parity = self._next(buf, writes=self.rank == root)
        if self.rank == root:
            slots[root].copy_(buf.view(-1))
            self._signal(self._others)
            self._owed[parity] = set(self._others)
            return
        self._wait([root])
        buf.view(-1).copy_(slots[root])

    def _heard(self, r: int) -> None:
        """A signal from rank r: it has finished every op before the one it signals."""
        for owed in self._owed:
            owed.discard(r)

    def _wait(self, ranks) -> None:
        missing = set(ranks)
        for r in list(missing):
            if self._credit[r]:
                self._credit[r] -= 1
                missing.discard(r)
                self._heard(r)
        deadline = time.monotonic() + self.timeout_s
        while missing:
            for r in self._signals(missing, deadline):
                self._heard(r)
                if r in missing:
                    missing.discard(r)
                else:
                    self._credit[r] += 1


class HostCollectives:
    """What a strategy (sync/base.py SyncStrategy) holds of the shared-memory collectives: whether
    it takes them, the run's choice, the channel its setup opened (or why not), and the two uses
    every strategy shares: the fast step's read of the losses (`sum_`) and the end (`close`)."""

    host_collectives: bool = False
    """Whether the strategy's collectives (`_average_`, the parameter server's gather and
    broadcast) may run through shared memory between CPU ranks of one host, where the run's
    --shared-memory allows; the fast step's read of the losses then goes there too."""
    shared_memory: str = "off"
    """The run's --shared-memory (set by train/rank.py before setup): auto, or off (Gloo)."""
    comm_note: Optional[str] = None
    """Why collectives that could have run through shared memory run on Gloo (auto), for the summary."""
    _shm: Optional[ShmCollectives] = None

    def open_host_collectives(self) -> None:
        """At setup, every rank together (collective): shared memory where the strategy takes it,
        the run allows it (--shared-memory auto), and its 2+ ranks are CPU processes of a Gloo
        group; else none, and comm_note says why where it could have been."""
        self.close()
        if not (self.host_collectives and self.world_size > 1 and self.shared_memory == "auto"
                and self.params_flat.device.type == "cpu" and dist.get_backend(self.group) == "gloo"):
            return
        ext = self.grads_ext
        self._shm, why = open_collectives(max(ext.numel() * ext.element_size(), READ_BYTES), self.rank,
                                          self.world_size, self.group, self.timeout_s or 300.0)
        self.comm_note = None if why is None else f"collectives run on Gloo, not shared memory: {why}"

    @property
    def collectives_path(self) -> Optional[str]:
        """shared-memory, gloo or nccl: how the strategy's collectives run (summary.json's
        `average`); None at one worker, and for strategies that never use shared memory."""
        if not self.host_collectives or self.world_size == 1:
            return None
        return "shared-memory" if self._shm is not None else dist.get_backend(self.group)

    def sum_(self, buf: torch.Tensor) -> None:
        """buf <- its sum over every rank of the run (the fast step's read of the losses): through
        shared memory where the strategy's collectives run there (its group is the run's) and it
        fits, else one all_reduce on the default group."""
        if self._shm is not None and self._shm.fits(buf):
            self._shm.sum_(buf)
        else:
            dist.all_reduce(buf)

    def close(self) -> None:
        """The run has ended, as it may (train/rank.py): the shared-memory collectives' files are closed."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None


def _agree(ok: bool, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def open_collectives(capacity: int, rank: int, world: int, group, timeout_s: float,
                     make: Type[ShmChannel] = ShmCollectives) -> Tuple[Optional[ShmChannel], Optional[str]]:
    """A ShmCollectives (or another `make` of ShmChannel: sync/shm_mailbox.py's) for buffers of up
    to `capacity` bytes (rounded up to 8), made by every rank of `group` together (collective), or
    (None, why not) where it cannot be used: every rank gets the same answer. The caller has
    checked that the group is Gloo's on the CPU."""
    if not 2 <= world <= MAX_WORLD:
        return None, f"{count(world, 'rank')} (shared memory takes 2-{MAX_WORLD})"
    capacity = -(-capacity // 8) * 8
    nbytes = 2 * world * capacity
    if nbytes > MAX_BYTES:
        return None, f"its buffers ({nbytes / 2**30:.1f} GiB) are above {MAX_BYTES >> 30} GiB"
    made: list = [None]
    if rank == 0:
        made = [_make(world, nbytes)]
    dist.broadcast_object_list(made, src=0, group=group)  # rank 0's folder (or why not) and host
    folder, host, why = made[0]
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=group)
    read_fd, write_fds = None, []
    try:
        if why is not None:
            return None, why
        ok = host == _host() and os.path.isdir(folder) and all(_alive(p) for p in pids)
        if ok:
            try:
                read_fd = os.open(os.path.join(folder, f"r{rank}"), os.O_RDONLY | os.O_NONBLOCK)
                slots = torch.from_file(os.path.join(folder, "slots"), shared=True, size=nbytes,
                                        dtype=torch.uint8).view(2, world, capacity)
            except (OSError, RuntimeError):
                ok = False
        if not _agree(ok, group):  # also: every reader is open, so the writers' opens do not block
            return None, "its ranks are not all on one host"
        try:
            write_fds = [None if r == rank else os.open(os.path.join(folder, f"r{r}"), os.O_WRONLY)
                         for r in range(world)]
        except OSError:
            ok = False
        if not _agree(ok, group):
            return None, f"{folder}: a rank could not open the others' FIFOs"
        os.set_blocking(read_fd, True)
        comm, read_fd, write_fds = make(slots, rank, world, read_fd, write_fds, pids, timeout_s), None, []
        return comm, None
    finally:
        for fd in [read_fd, *write_fds]:  # not handed to a ShmCollectives
            if fd is not None:
                os.close(fd)
        if folder is not None:
            try:
                dist.barrier(group=group)  # every rank has mapped and opened what it needs, or given up
            finally:  # also where a rank is gone and the barrier fails: the pages go with the folder
                if rank == 0:
                    shutil.rmtree(folder, ignore_errors=True)


def _make(world: int, nbytes: int) -> tuple:
    """Rank 0: the folder with the slots' file (its pages reserved) and a FIFO a rank, this host,
    and why not (None: made)."""
    folder = None
    _sweep_stale(_folder())
    try:
        folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=_folder())
        fd = os.open(os.path.join(folder, "slots"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        for r in range(world):
            os.mkfifo(os.path.join(folder, f"r{r}"), 0o600)
        return folder, _host(), None
    except OSError as e:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        return None, _host(), f"{_folder()}: {e.strerror or e} ({nbytes / 2**20:.0f} MiB)"


PREFIX = "shmlearn-allreduce-"
"""A folder of slots is named PREFIX + its maker's pid + "-" + a random part: it lives only while
the ranks set up (removed once all have mapped it), and one whose maker is gone (a rank 0 killed in
that window, its reserved pages still held by the file system) is removed by the next maker on the
host (`_sweep_stale`)."""


STALE_S = 60.0
"""A folder of slots is only removed as stale this long after it was made (its maker's pid may be
another PID namespace's, where /dev/shm is shared between containers)."""


def _sweep_stale(where: str) -> None:
    """Remove the folders of slots in `where` whose maker's process is gone, made STALE_S ago or more."""
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        path = os.path.join(where, name)
        try:
            old = time.time() - os.stat(path).st_mtime >= STALE_S
        except OSError:
            continue
        if pid.isdigit() and old and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
