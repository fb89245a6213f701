"""Checkpoints that survive kills: atomic, checksummed, one file per rank, complete or ignored.

Layout under the run directory:

    checkpoints/step-00000600/rank0.ckpt, rank1.ckpt, ...   each rank's own state
    checkpoints/step-00000600/COMPLETE                      written by rank 0 after every rank's
                                                            file is durable (a barrier)

A file is  MAGIC | sha256(payload) | len(payload) | payload  (payload = torch.save bytes),
written to a temp name (safe_write: removed on any error, a full disk included; never through
a symlink out of the run directory), fsynced, renamed, and the directory fsynced. A reader checks magic,
length and checksum, so a truncated file, a flipped byte or a rename that never happened (only
the temp file exists) is detected; resume then falls back to the previous good checkpoint.
The payload is read with torch.load(weights_only=True): tensors and plain values only (dicts,
lists, numbers, strings; RNG states are tensors), so a file that would run code when unpickled
(a planted or doctored checkpoint) is refused (UnsafeCheckpoint), never loaded (docs/security.md).
Each rank keeps its own file because not every strategy keeps replicas' state identical
(weight averaging between rounds; a parameter server's optimizer lives on rank 0 only).

A run's checkpoint (`run_state`, `save`; `resume`, `restore`) holds each rank's model, optimizer,
strategy and schedule state, its RNG states, the loop's history (times, losses, evaluations) and
the noise-scale tracker's state; `fields` (the config fields a resumption must agree on) and the
world size must match for a checkpoint to be resumed.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import shutil
import struct
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from shmlearn.record import readback

from shmlearn.record import runs

from shmlearn.record import safe_write
from shmlearn.errors import BadInput, Diverged, one_line

MAGIC = b"SHMLCKPT"
_HEADER = struct.Struct(">8s32sQ")
_DIR = re.compile(r"^step-(\d+)$")
KEEP = 2
"""Complete checkpoints kept on disk: the newest, and one to fall back to if it is damaged."""


class CorruptCheckpoint(Exception):
    pass


class UnsafeCheckpoint(CorruptCheckpoint):
    """A well-formed checkpoint whose payload holds more than tensors and plain values: unpickling
    it could run code, so it is refused, and not as damage to fall back from (resume stops)."""


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(root(run_dir), f"step-{step:08d}")


def write_file(path: str, state: Any, root: Optional[str] = None) -> None:
    """`state` as a checkpoint file at `path`, whole or not at all (root: the run directory, out
    of which no symlink is followed; default the file's folder)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    with safe_write.atomic_file(path, "wb", root=root, sync_dir=True) as f:
        f.write(_HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)))
        f.write(payload)


def read_file(path: str, map_location=None) -> Any:
    """The state in `path`, or CorruptCheckpoint saying what is wrong with it."""
    if not os.path.lexists(path):
        raise CorruptCheckpoint(f"{path}: missing")
    try:  # readback: a directory or a FIFO in its place is refused, never opened (a FIFO blocks)
        raw = readback.read_bytes(path)
    except BadInput as e:
        raise CorruptCheckpoint(str(e)) from None
    if len(raw) < _HEADER.size:
        raise CorruptCheckpoint(f"{path}: truncated ({len(raw)} bytes, shorter than the header)")
    magic, digest, n = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size:]
    if magic != MAGIC:
        raise CorruptCheckpoint(f"{path}: not a shmlearn checkpoint (bad magic)")
    if len(payload) != n:
        raise CorruptCheckpoint(f"{path}: truncated (header says {n} bytes, file has {len(payload)})")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{path}: checksum mismatch (damaged)")
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's refusal: what it would have had to import, or run
        raise UnsafeCheckpoint(f"{path}: refused: {readback.unpickle_refusal(e)}, and loading it could run code "
                               f"(a checkpoint holds only tensors and plain values)") from None


def candidates(run_dir: str) -> List[int]:
    """Steps of checkpoints marked COMPLETE, newest first."""
    r = root(run_dir)
    if not os.path.isdir(r):
        return []
    steps = []
    for name in os.listdir(r):
        m = _DIR.match(name)
        if m and os.path.exists(os.path.join(r, name, "COMPLETE")):
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def remove_incomplete(run_dir: str) -> List[str]:
    """Delete checkpoint folders without a COMPLETE mark (a kill while writing); their names."""
    import shutil
    r = root(run_dir)
    if not os.path.isdir(r):
        return []
    gone = [n for n in os.listdir(r) if _DIR.match(n) and not os.path.exists(os.path.join(r, n, "COMPLETE"))]
    for n in gone:
        shutil.rmtree(os.path.join(r, n), ignore_errors=True)
    return gone


def any_started(run_dir: str) -> bool:
    r = root(run_dir)
    return os.path.isdir(r) and any(_DIR.match(n) for n in os.listdir(r))


def mark_complete(run_dir: str, step: int, world_size: int) -> None:
    with safe_write.atomic_file(os.path.join(step_dir(run_dir, step), "COMPLETE"), "w", root=run_dir,
                                sync_dir=True) as f:
        f.write(f"{world_size}\n")


def prune(run_dir: str, keep: int = KEEP) -> None:
    """Delete all but the newest `keep` complete checkpoints (and abandoned partial ones older
    than the oldest kept)."""
    done = candidates(run_dir)
    if len(done) <= keep:
        return
    oldest_kept = done[keep - 1]
    for name in os.listdir(root(run_dir)):
        m = _DIR.match(name)
        if m and int(m.group(1)) < oldest_kept:
            shutil.rmtree(os.path.join(root(run_dir), name), ignore_errors=True)


def load_rank(run_dir: str, step: int, rank: int, map_location=None) -> Tuple[Optional[Any], Optional[str]]:
    """(state, None) or (None, why it is unusable) for this rank's file of checkpoint `step`.
    Raises UnsafeCheckpoint for a file that would run code: never a fallback, always a refusal."""
    path = os.path.join(step_dir(run_dir, step), f"rank{rank}.ckpt")
    try:
        state = read_file(path, map_location)
    except UnsafeCheckpoint:
        raise
    except CorruptCheckpoint as e:
        return None, str(e)
    why = malformed(state, step, path)
    return (None, why) if why else (state, None)


FREE_FIELDS = ("out", "resume", "progress", "timeout", "checkpoint_every", "threads", "workers", "oversubscribe",
               "save_model", "cudnn_benchmark")
"""Config fields that may differ between the original run and its resumption, or between ranks."""


def agreed_fields(cfg) -> dict:
    """The config fields (a TrainConfig's) that a resumption and every rank must agree on: the
    checkpoint's `fields` (guard.check_agreement compares them across ranks too)."""
    return {k: v for k, v in cfg.to_dict().items() if k not in FREE_FIELDS}


STATE = {"step": int, "world_size": int, "config": dict, "model": dict, "optimizer": dict, "strategy": dict,
         "schedule": dict, "rng": {"torch": torch.Tensor, "cuda": (torch.Tensor, None)}, "loop": dict,
         "noise": (dict, None)}
"""What a rank's checkpoint holds (run_state writes it), as `malformed` checks it."""
LOOP = {"step_times": list, "step_losses": list, "evals": list}


def malformed(state: Any, step: int, path: str) -> Optional[str]:
    """Why `state`, read from `path` (the folder of checkpoint `step`), is not a rank's checkpoint
    of that step; None when it is. The step it holds, and the steps its history covers, must be the
    folder's: a folder renamed (or copied from another run) would resume a run at a step it never
    reached and call it complete."""
    where = f"{path}: malformed"
    try:
        readback.need(state, STATE, where)
        readback.need(state["loop"], LOOP, f"{where}: 'loop'")
        bad = next((k for k, v in state["model"].items() if not isinstance(v, torch.Tensor)), None)
        if bad is not None:
            raise BadInput(f"{where}: 'model' entry {readback.shown(bad)} is not a tensor")
    except BadInput as e:
        return str(e)
    if state["step"] != step:
        return (f"{path}: holds step {state['step']}, not the folder's {step} (a renamed or copied folder?); "
                f"it does not belong here")
    if len(state["loop"]["step_losses"]) != step:
        return (f"{path}: its history covers {len(state['loop']['step_losses'])} steps, not its step {step}; "
                f"it does not belong to this run")
    return None


# -- a run's checkpoint: what the training loop (train/loop.py) saves and resumes -----------------

def run_state(step: int, world_size: int, fields: dict, *, strategy, optimizer, schedule, device: torch.device,
              loop: dict, noise) -> dict:
    """One rank's checkpoint at `step`. loop: the loop's history (its fields, by name);
    noise: the noise-scale tracker, or None."""
    return {"step": step, "world_size": world_size, "config": fields,
            "model": strategy.model.state_dict(), "optimizer": optimizer.state_dict(),
            "strategy": strategy.state_dict(), "schedule": schedule.state_dict(),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None},
            "loop": loop,
            "noise": noise.state_dict() if noise is not None else None}


def restore(state: dict, *, strategy, optimizer, schedule, device: torch.device) -> dict:
    """Put a `run_state` back into the strategy, optimizer, schedule and RNGs; the loop's history.
    A state that does not fit (shapes, keys: a checkpoint of another model) is BadInput in one line."""
    try:
        strategy.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        strategy.load_state_dict(state["strategy"])
        schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise BadInput(f"--resume: the checkpoint of step {state['step']} does not fit this run's model or "
                       f"optimizer ({one_line(e)})") from None
    if state["rng"]["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())
    return state["loop"]


def save(run_dir: str, step: int, rank: int, world_size: int, state: dict, fault=None) -> None:
    """Every rank writes its file; after a barrier rank 0 marks the checkpoint complete (and
    prunes the old ones). fault: the injected fault (guard.Fault) that may strike mid-checkpoint."""
    safe_write.makedirs(step_dir(run_dir, step), root=run_dir)
    write_file(os.path.join(step_dir(run_dir, step), f"rank{rank}.ckpt"), state, root=run_dir)
    if fault is not None:
        fault.in_checkpoint(rank, step)
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        mark_complete(run_dir, step, world_size)
        prune(run_dir)


def resume(run_dir: str, rank: int, world_size: int, device: torch.device, fields: dict) -> Tuple[int, Optional[dict]]:
    """(step, this rank's state) of the newest checkpoint that every rank can read and that
    matches the world size and `fields`; (0, None) if the run has none (rank 0 then clears the
    folders of checkpoints never completed). BadInput if checkpoints exist and none is usable,
    or one would run code when loaded. Collective: every rank calls it."""
    w, r, lead = world_size, rank, rank == 0
    found = [candidates(run_dir) if lead else None]
    if w > 1:
        dist.broadcast_object_list(found, src=0)
    problems = []
    for step in found[0]:
        try:
            state, why = load_rank(run_dir, step, r, map_location=device)
        except UnsafeCheckpoint as e:  # a file that would run code: refused, no fallback
            state, why = None, ("unsafe", str(e))
        if state is not None and (state["world_size"] != w or state["config"] != fields):
            state, why = None, _mismatch(state, w, fields)
        whys = [why]
        if w > 1:  # every rank learns every rank's verdict, so all choose the same step
            whys = [None] * w
            dist.all_gather_object(whys, why)
        unsafe = [x[1] for x in whys if isinstance(x, tuple)]
        if unsafe:  # every rank saw it (gathered): every rank raises
            raise BadInput(f"--resume: {unsafe[0]}")
        if all(x is None for x in whys):
            if problems and lead:
                print(f"shmlearn: skipped damaged checkpoints: {'; '.join(problems)}", flush=True)
            return step, state
        # Ranks often give the same verdict (a config or world-size mismatch): say it once.
        problems += [x for x in dict.fromkeys(whys) if x is not None]
    if found[0]:  # every rank knows found (broadcast): every rank raises
        raise BadInput(f"--resume {run_dir}: no usable checkpoint ({'; '.join(problems)})")
    # No complete checkpoint: start fresh, as --help says. One killed while it was written
    # is only a folder without its COMPLETE mark; rank 0 clears it (before its first
    # collective, so before any rank can write a checkpoint again).
    if lead:
        gone = remove_incomplete(run_dir)
        removed = f" (removed the incomplete {', '.join(gone)})" if gone else ""
        print(f"shmlearn: --resume: no complete checkpoint in {run_dir}{removed}; "
              f"starting from step 0", flush=True)
    return 0, None


def finished(run_dir: str, rank: int = 0, world_size: int = 1) -> Optional[dict]:
    """--resume on a run that already ended, before anything in its folder is touched: its
    summary (rank 0 says so, and where the results are) for a completed run; Diverged for a run
    that diverged (resuming would only replay it); None for a run to continue. Collective where
    world_size > 1 (rank 0 reads the run's files, every rank learns what it found: a damaged
    file is the same BadInput on every rank, not rank 0's alone while the others wait)."""
    got: List[Any] = [None]
    if rank == 0:
        try:
            got = [runs.finished(run_dir)]
        except BadInput as e:
            got = [e]
    if world_size > 1:
        dist.broadcast_object_list(got, src=0)
    summary = got[0]
    if isinstance(summary, BadInput):
        raise BadInput(str(summary))
    if summary is None:
        return None
    where = os.path.join(run_dir, "summary.json")
    if summary["status"] == "diverged":
        step, bad_rank = summary.get("diverged_step"), summary.get("diverged_rank")
        raise Diverged(f"--resume: {run_dir} already ended: it diverged at step {step} on rank {bad_rank}, and "
                       f"resuming would replay that; nothing was changed (its results are in {where})",
                       step=step if isinstance(step, int) else -1, rank=bad_rank if isinstance(bad_rank, int) else -1)
    if rank == 0:
        print(f"shmlearn: --resume: {run_dir} already completed ({summary.get('steps')} steps); nothing to "
              f"resume, nothing was changed; its results are in {where}", flush=True)
    return summary


def _mismatch(state: dict, world_size: int, fields: dict) -> str:
    if state["world_size"] != world_size:
        return f"step {state['step']}: written by {state['world_size']} processes, this run has {world_size}"
    diff = [k for k in fields if state["config"].get(k) != fields[k]]
    return f"step {state['step']}: written with different {', '.join(diff)}"
