"""`bench throughput` on one rank: every variant and batch, timed in repeats that every rank runs
together (the method is in shmlearn/bench/throughput.py's docstring), and the gradient sync alone.

_worker is the function the pool runs on each rank; it returns rank 0's rows.
"""
from __future__ import annotations

import math
import re
import time
from typing import Any, Dict, List, Optional

import torch

from shmlearn.bench.common import rank_device, stats, sync
from shmlearn.bench.throughput_runners import _build, _model, _sgd
from shmlearn.bench.throughput_variants import ThroughputConfig, _skipped, _variants
from shmlearn.errors import one_line
from shmlearn.config.limits import rank_threads
from shmlearn.step.compile import build_failure
from shmlearn.sync import build_strategy, registry

def _worker(env, cfg: dict):
    import warnings
    import torch.distributed as dist
    c = ThroughputConfig(**cfg)
    rank, world = env.rank, env.world_size
    # ps workers and `local` never call optimizer.step() in Python (graph replays, or rank 0 steps)
    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
    device = rank_device(env, "nccl" if c.device == "cuda" else "gloo")
    # Every variant, baselines included, with the threads a rank of `shmlearn train` gets (a GPU
    # rank few: limits.rank_threads), as torchrun gives DDP's ranks one.
    torch.set_num_threads(rank_threads(device.type, env.local_world_size, c.threads))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: every variant gets autotuned convs
    # Every compiled variant and batch is a new model compiled from the same forward code: past
    # Dynamo's default of 8 entries per code object it would silently run eagerly.
    from torch._dynamo import config as dynamo_config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    flag = torch.zeros(1, device=device)

    def barrier():
        dist.all_reduce(flag)
        sync(device)

    def slowest(t: float) -> float:
        v = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.item()

    rows = []
    for batch in c.batch_sizes:
        rows += _measure_batch(c, batch, device, rank, world, barrier, slowest)
    if world > 1:
        for m in c.sync_models:
            rows.append(_sync_bench(c, m, device, rank, world, barrier))
    return rows if rank == 0 else None


def _probe(runner, step: dict, v: str, steps: int, device, slowest) -> float:
    """Seconds per step over `steps` more steps after the warm-up: the warm-up's own time holds
    the first step (a shmlearn runner's first is eager, sampled), which made repeats too short."""
    t0 = time.perf_counter()
    for _ in range(max(steps, 10)):
        runner.step(step[v])
        step[v] += 1
    sync(device)
    return slowest((time.perf_counter() - t0) / max(steps, 10))


def _sample_every(runner) -> Optional[int]:
    """A shmlearn runner's period of eager, phase-timed steps among its graph replays, if any."""
    st = getattr(runner, "stepper", None)
    return st.sample_every if st is not None and st.graphs else None


def steps_per_repeat(seconds: float, per_step: float, sample_every: Optional[int] = None) -> int:
    """Steps in one timed repeat: about `seconds` of them (5 to 5000). A step replayed from a CUDA
    graph runs one step in `sample_every` eagerly, to time its phases; that step is part of its
    cost, so a repeat holds a whole number of periods (each repeat then carries the same share of
    them) wherever that stays within 10x `seconds`. Otherwise the share is left to chance, and
    small: such a step is slow enough that its eager run costs little more than its replay."""
    n = int(min(5000, max(5, math.ceil(seconds / max(per_step, 1e-6)))))
    if sample_every:
        whole = -(-n // sample_every) * sample_every
        if whole * per_step <= 10 * seconds:
            return whole
    return n


def agreed_steps_per_repeat(seconds: float, per_step: float, sample_every: Optional[int], agree_max) -> int:
    """steps_per_repeat, the same on every rank (the most any rank chose; agree_max: the maximum of a
    float over the ranks): a repeat's time is the slowest rank's, divided by this count. A `local`
    rank is a world of one and picks its own sampling period; when each rank kept its own count,
    rank 0's count was recorded against another rank's longer repeat (4 H200s, 2026-11-27: `local`
    read 1.92 ms for alexnet-small's 0.96 ms step, 71.8 ms for resnet18's 7.5 ms)."""
    return int(agree_max(float(steps_per_repeat(seconds, per_step, sample_every))))


def _measure_batch(c, batch, device, rank, world, barrier, slowest) -> List[dict]:
    """Build and warm up every variant, then time them round-robin (repeat 1 of each, repeat 2 of
    each, ...): a machine whose speed drifts (other load, clocks) bends every variant alike."""
    live = []  # (row, runner, steps per repeat, times)
    rows = []
    step = {}
    for v in _variants(c, world):
        row = {"workers": world, "batch": batch, "variant": v}
        rows.append(row)
        if _skipped(v, device):
            row["skipped"] = _skipped(v, device)
            continue
        try:
            t_build = time.perf_counter()
            runner = _build(c, v, device, batch, rank, world)
            row["mode"] = getattr(runner, "mode", "eager")
            if getattr(runner, "note", None):
                row["note"] = runner.note
            if getattr(runner, "compile_mode", None):  # a compile baseline: the torch.compile mode run
                row["compile_mode"] = runner.compile_mode
            st = getattr(runner, "stepper", None)
            if st is not None and st.compiled is not None:  # shmlearn --compile: its choice, its compile seconds
                row.update(compile=st.compiled, compile_s=st.compile_s, combo_kernels=st.combo)
            if st is not None and st.conv_overlaps:  # --conv-overlap: how many, and whether deferred
                row.update(conv_overlaps=st.conv_overlaps, conv_overlap_deferred=st.deferred,
                           update_in_backward=st.early_update, weight_copy=st.weight_copy)
            if st is not None and st.grad_buckets:  # the average in buckets during the backward
                row["grad_buckets"] = st.grad_buckets
            if st is not None and st.graphs:  # the captured step's memset nodes made kernels; its sampling
                row.update(memsets_replaced=st.memsets_replaced, largest_memset_bytes=st.memset_bytes,
                           sample_every=st.sample_every, eager_over_replay=round(st.eager_over_replay, 2))
            step[v] = 0
            barrier()
            for _ in range(c.warmup_steps):
                runner.step(step[v])
                step[v] += 1
            sync(device)
            row["setup_s"] = slowest(time.perf_counter() - t_build)
            per_step = _probe(runner, step, v, c.warmup_steps, device, slowest)
            n = agreed_steps_per_repeat(c.seconds, per_step, _sample_every(runner), slowest)
            live.append((row, runner, n, []))
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the rest
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            built = build_failure(e)
            if built is not None and built is not e:  # Dynamo's first line names no cause
                row["error"] += f" {one_line(built)}"
            if world > 1:
                raise  # the other ranks would wait in a collective
    for _ in range(c.repeats):
        for row, runner, n, times in live:
            v = row["variant"]
            if hasattr(runner, "flush"):
                runner.flush(step[v])
            barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                runner.step(step[v])
                step[v] += 1
            sync(device)
            times.append(slowest(time.perf_counter() - t0))
    for row, runner, n, times in live:
        if hasattr(runner, "flush"):
            runner.flush(step[row["variant"]])
        row.update(steps_per_repeat=n, repeat_s=stats(times), steps_per_s=stats([n / t for t in times]),
                   samples_per_s=stats([n * batch * world / t for t in times]))
        if getattr(runner, "bad", None):
            row["note"] = f"non-finite loss at step {runner.bad[0]} (random labels, lr {c.lr})"
        runner.close()
    live.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _sync_bench(c, model_name: str, device, rank: int, world: int, barrier) -> Dict[str, Any]:
    """shmlearn's gradient average of the flat buffer vs a bare all_reduce of the same bytes."""
    import torch.distributed as dist
    model = _model(c, device, model_name)
    s = build_strategy(registry.DEFAULT, rank=rank, world_size=world)  # the gradient all-reduce
    s.setup(model, _sgd(model.parameters(), c.lr))
    g = torch.Generator().manual_seed(rank)
    s.grads_ext.copy_(torch.randn(s.grads_ext.numel(), generator=g).to(device))
    bare = torch.randn(s.grads_ext.numel(), generator=g).to(device)
    nbytes = s.grads_ext.numel() * s.grads_ext.element_size()

    def timed(fn) -> float:
        barrier()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    out: Dict[str, Any] = {"sync_model": model_name, "workers": world, "bytes": nbytes,
                           "params": s.grads_flat.numel()}
    factor = 2 * (world - 1) / world
    for name, fn in (("shmlearn", lambda: s._average_(s.grads_ext)),
                     ("bare_all_reduce", lambda: dist.all_reduce(bare))):
        for _ in range(3):
            timed(fn)
        ts = torch.tensor([timed(fn) for _ in range(c.sync_iters)], dtype=torch.float64, device=device)
        dist.all_reduce(ts, op=dist.ReduceOp.MAX)
        st = stats(ts.tolist())
        out[name] = {"time_s": st, "busbw_GBps": nbytes * factor / st["median"] / 1e9}
    out["ratio"] = out["shmlearn"]["busbw_GBps"] / out["bare_all_reduce"]["busbw_GBps"]
    return out
