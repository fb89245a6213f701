"""Keeping ranks honest: agreement at setup, a heartbeat that names a hung rank, fault injection.

* `check_agreement`: before the first broadcast, every rank shows the others its config, its
  dataset's fingerprint and its model's parameter shapes (one all-reduce of their digests on
  Gloo, then one all_gather_object where they differ, to name who); after the broadcast, a hash
  of the weights. A rank that differs is named on every rank (exit 2) instead of
  a broadcast of mismatched buffers hanging or crashing.
* `Heartbeat`: a daemon thread posts this rank's step to the process group's store once a second
  (never on the hot path). When a collective times out, the ranks that are still alive read the
  others' last steps and name the one that is behind.
* `Fault`: SHMLEARN_FAULT=kind:rank:step (kill, sleep, nan, raise, stop, kill-in-checkpoint; slow:rank:ms
  delays every gradient of the rank by ms, a straggler) makes one rank misbehave at
  one step (a free-running strategy's worker: at its step-th gradient), so the reliability
  tests exercise the real code paths. It fires only in a fresh run,
  never after a resume or an elastic restart.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist

from shmlearn.errors import BadInput, Diverged, WorkerFailed, one_line


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
    return h.hexdigest()[:16]


def data_fingerprint(data) -> str:
    """Sizes, shape, and a sample of values: cheap, and different files practically never match."""
    def sample(t: torch.Tensor):
        flat = t.reshape(-1)
        idx = torch.linspace(0, len(flat) - 1, steps=min(4096, len(flat)), dtype=torch.float64).long()
        return flat[idx].double().sum().item()
    if hasattr(data, "tensors"):  # the general contract's trees (data/tree.py): every tensor of every split
        return _digest(data.spec, data.n_train, data.n_val, data.n_test,  # a lazy split's tensors: its first rows
                       *((tuple(t.shape), str(t.dtype), sample(t) if t.numel() else 0.0)
                         for t in data.tensors()))
    if not hasattr(data, "train_x"):  # streamed (data/stream.py): sizes and the first samples
        return _digest(data.spec, data.n_train, data.n_test, *(sample(torch.as_tensor(v)) for v in
                                                               (*data.train[0], *data.test[0])))
    return _digest(data.spec, tuple(data.train_x.shape), tuple(data.test_x.shape),
                   sample(data.train_x), sample(data.train_y), sample(data.test_x), sample(data.test_y))


def check_agreement(cfg_dict: dict, data, model: torch.nn.Module, rank: int, world_size: int) -> None:
    """Every rank raises the same BadInput if any rank's config, data or model differs."""
    if world_size == 1:
        return
    mine = {"config": _digest(sorted(cfg_dict.items())), "dataset": data_fingerprint(data),
            "model": _digest([(n, tuple(p.shape)) for n, p in model.named_parameters()])}
    # The usual case, on Gloo (a CPU tensor): one all-reduce; the all-gather below only names who differs.
    if dist.get_backend() == "gloo" and _same_everywhere([int(mine[k], 16) >> 1 for k in ("config", "dataset", "model")]):
        return
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    for what in ("config", "dataset", "model"):
        odd = [r for r in range(world_size) if everyone[r][what] != everyone[0][what]]
        if odd:
            raise BadInput(f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} "
                           f"{'have' if len(odd) > 1 else 'has'} a different {what} from rank 0 "
                           f"(same command, files and code on every rank?)")


def check_replicas(params_flat: torch.Tensor, world_size: int) -> None:
    """After the initial broadcast every replica must hold rank 0's weights, bit for bit."""
    if world_size == 1:
        return
    h = torch.tensor([float(params_flat.double().sum()), float(params_flat.double().abs().sum())],
                     dtype=torch.float64, device=params_flat.device)
    if not _same_everywhere(h):
        raise RuntimeError("replicas differ after the initial broadcast")


def _same_everywhere(values) -> bool:
    """Whether every rank holds the same `values` (float64 or int64 below 2**63 in magnitude, a
    tensor or a list of ints): on Gloo one all-reduce of (v, -v) with MIN, whose halves are the
    least and, negated, the greatest value of each (a NaN is never the same). One collective, not
    two: each was 0.3-1 ms of a CPU trial's setup between two ranks on 2 loaded cores."""
    v = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    if dist.get_backend() != "gloo":  # NCCL (the replicas' check on GPUs): its two all-reduces, as before
        lo, hi = v.clone(), v.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return torch.equal(lo, hi)
    both = torch.cat([v, -v])
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    return torch.equal(both[:len(v)], -both[len(v):])


def _interrupt_main() -> None:
    """Run SIGINT's Python handler in the main thread, ending the system call it is blocked in (a
    sleep, a lock, a read), which _thread.interrupt_main alone leaves to finish first: one real
    SIGINT to that thread, where Python handles SIGINT (both together could run the handler twice).
    Where it does not, interrupt_main, which then does nothing, as a SIGINT would not."""
    import _thread
    if callable(signal.getsignal(signal.SIGINT)):
        try:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return
        except (OSError, ValueError):
            pass
    _thread.interrupt_main()


class Heartbeat:
    def __init__(self, rank: int, world_size: int, interval_s: float = 1.0, tag: str = "", store=None,
                 timeout_s: Optional[float] = None):
        """tag and store: a pooled job's name (launch.DistEnv.job) and the pool's own store
        (pool.worker_store). Such a job posts there even at one rank, where the pool reads the
        posts to notice a stopped rank, or one inside a step for longer than the job's timeout
        (launch.supervise.Watchdog._stopped_rank). Otherwise the posts go to the process group's store.
        timeout_s: a lone rank with no store (an in-process 1-worker run) is watched here instead:
        inside one step for longer than this, the run is stopped naming it (`stalled`)."""
        self.rank, self.world_size = rank, world_size
        self._step = -1
        self._entered: Optional[float] = None  # monotonic time the rank entered its current step
        self.stalled: Optional[str] = None
        """Why the watch stopped the run: 'rank 0: no progress for 9 s inside step 31 ...'."""
        self._prefix = f"shmlearn/hb/{tag}/" if tag else "shmlearn/hb/"
        self._store = store
        if store is None and world_size > 1:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - no store: hangs are still ended by the timeout
                self._store = None
        self._stop = threading.Event()
        self._thread = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        elif world_size == 1 and timeout_s:  # nobody waits on a lone rank in a collective
            self._thread = threading.Thread(target=self._watch, args=(timeout_s,), daemon=True)
        if self._thread is not None:
            self._thread.start()

    @property
    def step(self) -> int:
        """The step whose per-step sync this rank has reached (set by the loop, read by the thread)."""
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step, self._entered = step, None

    def begin(self) -> None:
        """The rank enters its next step (evaluation and checkpoints, between steps, are not watched)."""
        self._entered = time.monotonic()

    def inside_s(self) -> float:
        """Seconds the rank has been inside its current step; -1 between steps."""
        entered = self._entered
        return -1.0 if entered is None else time.monotonic() - entered

    def _run(self, interval_s: float) -> None:
        while True:
            try:
                self._store.set(f"{self._prefix}{self.rank}", f"{self.step} {time.time():.3f} {self.inside_s():.1f}")
            except Exception:  # noqa: BLE001 - the store's host died; the collective will say so
                return
            if self._stop.wait(interval_s):
                return

    def _watch(self, timeout_s: float) -> None:
        """A lone rank's hang in its own code (a stuck user model or loss): no peer's collective
        times out on it, and its process is alive. Past the timeout, say so and interrupt the main
        thread (the loop turns that into WorkerFailed); if it is stuck where no interrupt
        reaches, end the process."""
        while not self._stop.wait(1.0):
            inside = self.inside_s()
            if inside > timeout_s:
                self.stalled = (f"rank {self.rank}: no progress for {inside:.0f} s inside step {self.step + 1} "
                                f"(--timeout {timeout_s:g} s): a hang in its own code")
                print(f"shmlearn: {self.stalled}", file=sys.stderr, flush=True)
                _interrupt_main()
                if not self._stop.wait(10.0):
                    os._exit(1)
                return

    def stop(self) -> None:
        """Stop and join, so the thread is not inside a store call when the group is destroyed."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    @contextlib.contextmanager
    def naming_the_cause(self):
        """Around a rank's loop: an error that a stalled peer caused names that peer, and the
        watch's interrupt becomes the failure it found."""
        try:
            yield
        except (BadInput, Diverged):
            raise
        except KeyboardInterrupt:
            if self.stalled:
                raise WorkerFailed(self.stalled) from None
            raise
        except Exception as e:  # noqa: BLE001 - name the rank that stalled the collective, if any
            who = self.laggards()
            if who:
                raise WorkerFailed(f"{who} stopped responding; rank {self.rank} gave up waiting "
                                   f"({one_line(e)})") from e
            raise

    def laggards(self) -> str:
        """Who is behind, from the others' last posts: 'rank 1 (last at step 4, 11 s ago)'."""
        if self._store is None:
            return ""
        import datetime
        try:  # the store's host may be the stopped process: ask briefly, never wait on it
            self._store.set_timeout(datetime.timedelta(seconds=5))
        except Exception:  # noqa: BLE001
            pass
        seen: Dict[int, tuple] = {}
        for r in range(self.world_size):
            key = f"{self._prefix}{r}"
            try:
                if self._store.check([key]):
                    step, t = self._store.get(key).decode().split()[:2]
                    seen[r] = (int(step), float(t))
            except Exception:  # noqa: BLE001 - the store does not answer: its host is gone
                # Locally the pool hosts it (and names a stopped rank itself); under mpirun and
                # srun, rank 0 does, under torchrun its agent.
                return "rank 0 or the launcher (the rendezvous store does not answer)"
        now = time.time()
        missing = [r for r in range(self.world_size) if r not in seen]
        if not seen:
            return ""
        front = max(s for s, _ in seen.values())
        behind = [r for r, (s, _) in seen.items() if s < front] + missing
        stale = [r for r, (_, t) in seen.items() if now - t > 5 and r not in behind]
        names = sorted(set(behind + stale))

        def why(r: int) -> str:
            if r not in seen:
                return "never reported"
            s, t = seen[r]
            # Posts are once a second: a rank that stopped in its first second posted no step yet.
            last = f"last at step {s}" if s >= 0 else "no step posted yet"
            return (f"never reached the sync of step {front}, {last}" if s < front
                    else f"silent for {now - t:.0f} s") + f", last heartbeat {now - t:.0f} s ago"
        return ", ".join(f"rank {r} ({why(r)})" for r in names)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    @staticmethod
    def from_env(resumed: bool) -> Optional["Fault"]:
        spec = os.environ.get("SHMLEARN_FAULT")
        if not spec or resumed or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        kind, rank, step = spec.split(":")
        kinds = ("kill", "sleep", "nan", "raise", "stop", "kill-in-checkpoint", "slow")
        if kind not in kinds:
            raise BadInput(f"SHMLEARN_FAULT={spec}: kind must be {', '.join(kinds[:-1])} or {kinds[-1]}")
        return Fault(kind, int(rank), int(step))

    def in_checkpoint(self, rank: int, step: int) -> None:
        """kill-in-checkpoint: die after this rank's file of the checkpoint at `step` is written,
        before the checkpoint is marked complete (a kill during a checkpoint)."""
        if self.kind == "kill-in-checkpoint" and rank == self.rank and step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def fire(self, rank: int, step: int, loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.kind == "slow":  # slow:RANK:MS: every gradient of RANK takes MS ms longer (a straggler)
            if rank == self.rank:
                time.sleep(self.step / 1000)
            return loss
        if self.kind == "kill-in-checkpoint" or rank != self.rank or step != self.step:
            return loss
        if os.environ.get("SHMLEARN_FAULT_LOG"):  # when it fired: a test times what follows from here
            with open(os.environ["SHMLEARN_FAULT_LOG"], "a") as f:
                f.write(f"{time.time():.3f} {self.kind} {rank} {step}\n")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stop":  # SIGSTOP: the process, its heartbeat thread included, freezes
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.kind == "sleep":
            time.sleep(3600)
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at step {step}")
        return loss * float("nan") if loss is not None else loss
