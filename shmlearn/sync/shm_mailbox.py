"""async-ps's messages between the CPU ranks of one host through shared memory (--shared-memory
auto): each worker's gradient push (with its version) to the server and the server's weight reply
(with theirs), in place of Gloo's point-to-point messages over loopback TCP.

Why: a Gloo message between local processes is a round of TCP through Gloo's threads, about a
millisecond for the digits MLP's 200 KB on a 2-core machine; async-ps's workers spent most of
their time waiting on them (docs/strategies.md, "How the ranks talk", has the measurement).

How: sync/shm.py's channel (`open_collectives`: one file of slots in /dev/shm, unlinked once every
rank has mapped it, a FIFO a rank for one-byte signals, the same-host check, the room check, one
all-reduce so every rank takes the same path) with its slots used as one mailbox per worker r:
set 0, row r holds r's push (its gradient, control slots and version), set 1, row r the server's
reply to r (the weights and their version). Row 0 of each set (the server's) is unused.
* A worker writes its push into its row and signals the server (one byte, its rank, into the
  server's FIFO); it then waits for the server's signal and reads its reply row.
* The server takes signals in the order they were written into its FIFO: the workers' pushes in
  arrival order, as Gloo's receive from any source gives them. It copies a push out of the row
  before it answers (a pending gradient may be applied updates later, while the worker, answered,
  writes its next push there), then writes the reply row and signals the worker.
* Each row has one writer, and the exchange alternates (push, reply, push, ...): a worker writes
  its push row again only after its reply, which the server sends after copying the push out; the
  server writes a reply row again only after that worker's next push, sent after it read the
  reply. No slot is written while it may still be read; the pipe's write and read order a row's
  writes before its reads.
* A dead or hung peer: the wait polls the FIFO and every second checks that the ranks it waits for
  still exist (ShmChannel._signals); a process gone, or no word within --timeout, is this rank's
  error naming the rank.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Optional, Tuple

import torch

from shmlearn.sync.shm import ShmChannel, open_collectives

PUSH, REPLY = 0, 1
"""The slots' two sets: the workers' pushes, the server's replies."""


class ShmMailbox(ShmChannel):
    """A mailbox per worker in shared memory (module docstring): the server takes pushes from any
    worker in arrival order (`take`) and answers one (`post`); a worker posts its push and waits
    for the answer (`post`, `wait_for`)."""

    what = "shared-memory messages"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._arrived: deque = deque()  # signals read but not yet taken, in arrival order

    def slot(self, kind: int, r: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Worker r's push row (kind PUSH) or reply row (REPLY) as `numel` values of `dtype`: a view
        of the shared slots, written by one rank and read by the other."""
        n = numel * torch.empty((), dtype=dtype).element_size()
        if n > self.slots.shape[-1] or not 1 <= r < self.world:
            raise ValueError(f"mailbox of rank {r}: {n} bytes in rows of {self.slots.shape[-1]} of {self.world} ranks")
        return self.slots[kind, r, :n].view(dtype)

    def post(self, to: int) -> None:
        """Tell rank `to` that this rank's row for it is written (a push, or a reply)."""
        self._signal([to])

    def take(self, expecting: Iterable[int]) -> int:
        """The server: the rank of the next push, in arrival order (waits: for a rank of
        `expecting`, the workers still computing, named if it ends or stays silent past --timeout)."""
        missing = set(expecting) or set(range(1, self.world))
        deadline = time.monotonic() + self.timeout_s
        while not self._arrived:
            self._arrived.extend(self._signals(missing, deadline))
        return self._arrived.popleft()

    def wait_for(self, r: int) -> None:
        """A worker: wait for rank r's (the server's) signal that its reply is written."""
        deadline = time.monotonic() + self.timeout_s
        while not self._arrived:
            self._arrived.extend(self._signals({r}, deadline))
        got = self._arrived.popleft()
        if got != r:
            raise RuntimeError(f"{self.what}: rank {self.rank} heard from rank {got}, expected rank {r}")


def open_mailbox(push: int, reply: int, dtype: torch.dtype, rank: int, world: int, group,
                 timeout_s: float) -> Tuple[Optional[ShmMailbox], Optional[str]]:
    """Every rank of `group` together (collective): a ShmMailbox whose rows hold a push of `push`
    and a reply of `reply` values of `dtype`, or (None, why not), the same answer on every rank,
    where sync/shm.py's collectives could not run either (another host, too big, no room)."""
    each = torch.empty((), dtype=dtype).element_size()
    return open_collectives(max(push, reply) * each, rank, world, group, timeout_s, make=ShmMailbox)
