"""`shmlearn bench comm`: latency and bus bandwidth of the collectives against message size and
worker count, on real process groups (Gloo on CPU processes, NCCL with one process per GPU), by
the path a training run's collectives take: on CPU ranks of one host, by default
(`--shared-memory auto`, train's flag and default) the shared-memory collectives of sync/shm.py,
called as the strategies call them: all_reduce is allreduce's and weight-avg's average (`sum_`,
then divide by W), gather and broadcast are ps's; `--shared-memory off` times Gloo's. The ops no
strategy runs through shared memory (reduce, all_gather, reduce_scatter) are Gloo's either way,
and where a run would fall back to Gloo (one rank; a mapping of 2 x W x the buffer above
shm.MAX_BYTES; no room in /dev/shm) so does the benchmark, with a note. Every row records its path
(`collectives`: shared-memory, gloo or nccl), and env.collectives the document's (shared-memory
if any row is); files written before the field (schema 1 without it) are Gloo's (or NCCL's).

Conventions are nccl-tests' (its doc/PERFORMANCE.md), so the numbers compare with published ones:

* `bytes` is the size nccl-tests calls "size": the buffer of all_reduce, reduce and broadcast;
  the whole (W-chunk) output of all_gather and gather; the whole input of reduce_scatter.
* algbw = bytes / time. busbw = algbw x factor(W): the rate each rank's link must carry for the
  operation to take that long in an optimal algorithm, comparable across W:
  all_reduce 2(W-1)/W; reduce_scatter, all_gather, gather (W-1)/W; broadcast, reduce 1.

Method per (W, op, size): fresh random data (never zeros: they can run faster than real data);
`warmup` untimed calls; then each timed call is preceded by a refill of the buffers that the
collective modifies in place (untimed) and a barrier, and timed by perf_counter on CPU or CUDA
events on GPU. A call's time is the slowest rank's (the collective is done when every rank is);
the JSON keeps the median and the spread over calls.

Shared memory: the protocol's rules (sync/shm.py: a rank writes a set of slots again only after
word from the ranks that read it) allow the sequences a run makes: sums back to back, and ps's
gather then broadcast. So before each point one untimed sum of a flag, then for a timed gather an
untimed broadcast of a flag after it, and for a timed broadcast an untimed gather before it; the
barrier before each timed call stays Gloo's (the same for both paths).

`--compute-ms T` puts T ms of computation (matrix products on the rank's device, one thread on
CPU) before each call's barrier: the collective as a training step meets it, after its forward and
backward, rather than back to back. On a CPU box whose cores the ranks share, the two differ
several-fold (Gloo on 2 processes sharing 2 cores; the numbers: docs/scaling.md), and `shmlearn
simulate` fitted to the back-to-back numbers under-predicts a CPU run's step.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

from shmlearn.bench.common import (RANK_TIMEOUT_S, check_backend, environment, format_size, parse_int_list,
                                   parse_size, rank_device, stats, sync, try_pyplot)
from shmlearn.record import safe_write
from shmlearn.errors import BadInput
from shmlearn.config.limits import rank_threads
from shmlearn.launch.pool import run_local
from shmlearn.bench.parsers import DTYPE_NAMES, OPS  # the names its parser lists, without torch
from shmlearn.sync import shm as shm_mod

SHM_OPS = ("all_reduce", "gather", "broadcast")
"""The ops a run's strategies make through shared memory (the others are Gloo's in every run)."""


BUS_FACTOR = {  # nccl-tests doc/PERFORMANCE.md
    "all_reduce": ("2(W-1)/W", lambda w: 2 * (w - 1) / w),
    "reduce_scatter": ("(W-1)/W", lambda w: (w - 1) / w),
    "all_gather": ("(W-1)/W", lambda w: (w - 1) / w),
    "gather": ("(W-1)/W", lambda w: (w - 1) / w),
    "broadcast": ("1", lambda w: 1.0),
    "reduce": ("1", lambda w: 1.0),
}

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def default_sizes(min_size: int = 4 << 10, max_size: int = 256 << 20, factor: int = 4) -> List[int]:
    """min_size, min_size*factor, ... up to max_size (inclusive)."""
    sizes, s = [], min_size
    while s <= max_size:
        sizes.append(s)
        s *= factor
    return sizes


@dataclass(kw_only=True)
class CommConfig:
    backend: str = "gloo"
    """gloo (CPU processes) or nccl (one process per GPU)."""
    workers: List[int] = field(default_factory=lambda: [2, 3, 4])
    """World sizes to measure; each is a fresh process group."""
    ops: List[str] = field(default_factory=lambda: list(OPS))
    sizes: List[int] = field(default_factory=default_sizes)
    """Message sizes in bytes, nccl-tests convention (see the module docstring)."""
    dtype: str = "float32"
    warmup: int = 3
    """Untimed calls before timing (connection setup, allocator, NCCL channel setup)."""
    iters: int = 20
    """Timed calls at most."""
    min_iters: int = 5
    """Timed calls at least, even when one call takes longer than budget_s allows."""
    budget_s: float = 2.0
    """Seconds of timed calls per (W, op, size): large messages on slow links get fewer calls."""
    repeats: int = 1
    """Sweeps of every W (each a fresh process group, the sweeps in turn): a point keeps the row of
    the sweep with its median median, so a burst of load elsewhere during one sweep does not move it."""
    threads: Optional[int] = None
    """CPU: intra-op threads per process (default: cores / W, at least 1)."""
    compute_ms: float = 0.0
    """Milliseconds of computation on every rank before each call (0: back to back)."""
    shared_memory: str = "auto"
    """gloo: auto times the shared-memory collectives a run of one host's CPU ranks uses (train's
    --shared-memory auto) where they can run, else Gloo, as a run falls back; off: Gloo always."""


def _count(nbytes: int, world: int, elem: int) -> int:
    return max(world, nbytes // elem // world * world)  # divisible by W: chunked ops need it


def rank_bytes(op: str, nbytes: int, world: int, elem: int) -> int:
    """Bytes of one rank's buffer in a shared-memory slot: gather's chunk, else the whole buffer."""
    n = _count(nbytes, world, elem)
    return (n // world if op == "gather" else n) * elem


def _buffers(op: str, nbytes: int, world: int, rank: int, dtype, device) -> Dict[str, Any]:
    elem = torch.tensor([], dtype=dtype).element_size()
    count = _count(nbytes, world, elem)
    chunk = count // world
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    rnd = lambda n: torch.randn(n, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)  # noqa: E731
    b: Dict[str, Any] = {"count": count, "bytes": count * elem}
    if op in ("all_reduce", "reduce", "broadcast"):
        b["buf"] = rnd(count)
        b["src"] = b["buf"].clone()  # in-place reductions would grow without bound: refill
    elif op == "all_gather":
        b["inp"], b["out"] = rnd(chunk), torch.empty(count, dtype=dtype, device=device)
    elif op == "reduce_scatter":
        b["inp"], b["out"] = rnd(count), torch.empty(chunk, dtype=dtype, device=device)
        b["src"] = b["inp"].clone()  # Gloo may reduce in the input buffer
    elif op == "gather":
        b["inp"] = rnd(chunk)
        b["out"] = list(torch.empty(count, dtype=dtype, device=device).chunk(world)) if rank == 0 else None
    return b


def _call(op: str, b: Dict[str, Any]) -> None:
    import torch.distributed as dist
    if op == "all_reduce":
        dist.all_reduce(b["buf"])
    elif op == "reduce":
        dist.reduce(b["buf"], dst=0)
    elif op == "broadcast":
        dist.broadcast(b["buf"], src=0)
    elif op == "all_gather":
        dist.all_gather_into_tensor(b["out"], b["inp"])
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(b["out"], b["inp"])
    elif op == "gather":
        dist.gather(b["inp"], b["out"], dst=0)


def _shm_call(op: str, b: Dict[str, Any], comm, world: int) -> None:
    """The call as the strategies make it (sync/base.py `_average_`, sync/parameter_server.py)."""
    if op == "all_reduce":
        comm.sum_(b["buf"])
        b["buf"].div_(world)  # the average: the sum, then one pass to scale
    elif op == "gather":
        comm.gather(b["inp"])  # the root reads the rows in place (ps averages from them)
    elif op == "broadcast":
        comm.broadcast_(b["buf"])


def shm_capacity(ops, sizes, world: int, elem: int) -> int:
    """The largest per-rank buffer (bytes) among the shared-memory points whose mapping (2 x W x
    buffer, sync/shm.py) fits in shm.MAX_BYTES: bigger ones are Gloo's, as in a run; 0 if none."""
    fit = [n for n in (rank_bytes(op, s, world, elem) for op in ops if op in SHM_OPS for s in sizes)
           if 2 * world * (-(-n // 8) * 8) <= shm_mod.MAX_BYTES]
    return max(fit, default=0)


def _open_shm(c: CommConfig, world: int, rank: int, elem: int) -> tuple:
    """(ShmCollectives or None, the largest per-rank bytes it takes, why not or None), every rank
    together: open where a run would (train --shared-memory auto on CPU ranks of one host)."""
    if c.backend != "gloo" or c.shared_memory != "auto" or not any(op in SHM_OPS for op in c.ops):
        return None, 0, None
    capacity = shm_capacity(c.ops, c.sizes, world, elem)
    if capacity == 0 and world >= 2:
        return None, 0, f"every size is above shared memory's {shm_mod.MAX_BYTES >> 30} GiB mapping at W={world}"
    comm, why = shm_mod.open_collectives(max(capacity, 8), rank, world, None, RANK_TIMEOUT_S)
    return comm, (capacity if comm is not None else 0), why


def _refill(op: str, b: Dict[str, Any]) -> None:
    if op in ("all_reduce", "reduce", "broadcast"):
        b["buf"].copy_(b["src"])
    elif op == "reduce_scatter":
        b["inp"].copy_(b["src"])


def _worker(env, cfg: dict) -> Optional[tuple]:
    import torch.distributed as dist
    c = CommConfig(**cfg)
    rank, world = env.rank, env.world_size
    # torch >= 2.12 renames the *_tensor collectives; the old names still work back to 2.4.
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed")
    device = rank_device(env, c.backend)
    torch.set_num_threads(rank_threads(device.type, env.local_world_size, c.threads))
    dtype = DTYPES[c.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    flag = torch.zeros(1, device=device)
    mat = torch.randn(256, 256, device=device)  # random, never zeros (see the module docstring)
    comm, capacity, why = _open_shm(c, world, rank, elem)
    notes = [] if why is None else [f"W={world}: Gloo, not shared memory: {why}"]
    tiny = torch.randn(2)  # the untimed partner ops' buffer (shared memory; see the module docstring)

    def compute(ms: float) -> None:  # a training step's compute phase before its collective
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < ms / 1e3:
            mat.copy_(torch.tanh(mat @ mat) * 0.5)  # bounded: no overflow however long it runs
            sync(device)

    def barrier() -> None:  # a tiny all-reduce, then drain the stream: every rank starts together
        dist.all_reduce(flag)
        sync(device)

    def timed(op: str, b: dict, shm) -> float:
        _refill(op, b)
        if shm is not None and op == "broadcast":
            shm.gather(tiny)  # ps's order: a gather before each broadcast
        if c.compute_ms > 0:
            compute(c.compute_ms)
        barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _call(op, b)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        if shm is not None:
            _shm_call(op, b, shm, world)
        else:
            _call(op, b)  # Gloo calls without async_op block until done
        t = time.perf_counter() - t0
        if shm is not None and op == "gather":
            shm.broadcast_(tiny)  # ps's order: a broadcast after each gather
        return t

    rows = []
    try:
        for op in c.ops:
            for size in c.sizes:
                b = _buffers(op, size, world, rank, dtype, device)
                shm = comm if op in SHM_OPS and 0 < rank_bytes(op, size, world, elem) <= capacity else None
                if comm is not None and op in SHM_OPS and shm is None:
                    notes.append(f"W={world} {op} {format_size(b['bytes'])}: Gloo, not shared memory: the mapping "
                                 f"(2 x W x buffer) is above {shm_mod.MAX_BYTES >> 30} GiB")
                if shm is not None:
                    shm.sum_(tiny)  # every rank has word from every other: any sequence may start
                warm = [timed(op, b, shm) for _ in range(c.warmup)]
                # Every rank must run the same number of calls: decide from the slowest warmup.
                t = torch.tensor([max(warm) if warm else 0.0], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                per_call = max(t.item(), 1e-9)
                n = int(min(c.iters, max(c.min_iters, math.ceil(c.budget_s / per_call))))
                times = torch.tensor([timed(op, b, shm) for _ in range(n)], dtype=torch.float64, device=device)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a call ends when the slowest rank is done
                if rank == 0:
                    s = stats(times.tolist())
                    factor = BUS_FACTOR[op][1](world)
                    rows.append({"op": op, "world_size": world, "bytes": b["bytes"], "count": b["count"],
                                 "dtype": c.dtype, "iters": n, "warmup": c.warmup, "time_s": s,
                                 "algbw_GBps": b["bytes"] / s["median"] / 1e9,
                                 "busbw_GBps": b["bytes"] / s["median"] / 1e9 * factor,
                                 "collectives": "shared-memory" if shm is not None else c.backend})
                del b
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if comm is not None:
            comm.close()
    return (rows, notes) if rank == 0 else None


def run(cfg: CommConfig, *, log=print) -> Dict[str, Any]:
    """Measure every (W, op, size) of `cfg`; return the JSON document (see the module docstring)."""
    check_backend(cfg.backend, cfg.workers)
    bad = [o for o in cfg.ops if o not in OPS]
    if bad:
        raise BadInput(f"--ops {','.join(bad)}: unknown; choose from {','.join(OPS)}")
    if cfg.dtype not in DTYPES:
        raise BadInput(f"--dtype {cfg.dtype}: choose one of {', '.join(DTYPES)}")
    if cfg.shared_memory not in ("auto", "off"):
        raise BadInput(f"--shared-memory {cfg.shared_memory}: choose auto or off")
    doc: Dict[str, Any] = {"benchmark": "comm", "schema": 1, "env": environment(cfg.backend),
                           "config": asdict(cfg),
                           "bus_factor": {op: f for op, (f, _) in BUS_FACTOR.items()},
                           "size_convention": "nccl-tests: buffer of all_reduce/reduce/broadcast, "
                                              "total output of all_gather/gather, total input of reduce_scatter",
                           "results": []}
    if cfg.repeats < 1:
        raise BadInput(f"--repeats {cfg.repeats}: must be >= 1")
    notes: List[str] = []
    sweeps: Dict[tuple, List[dict]] = {}  # (op, W, bytes) -> its row of each sweep, in order
    for rep in range(cfg.repeats):
        for w in cfg.workers:
            t0 = time.perf_counter()
            rows, why = run_local(_worker, (asdict(cfg),), w, cuda=cfg.backend == "nccl", timeout_s=RANK_TIMEOUT_S)[0]
            for r in rows:
                sweeps.setdefault((r["op"], r["world_size"], r["bytes"]), []).append(r)
            notes.extend(n for n in why if n not in notes)
            paths = sorted({r["collectives"] for r in rows})
            log(f"bench comm: {cfg.backend} W={w}" + (f" (sweep {rep + 1}/{cfg.repeats})" if cfg.repeats > 1 else "")
                + f": {len(rows)} points ({', '.join(paths)}) in {time.perf_counter() - t0:.1f} s")
            for n in why:
                log(f"bench comm: {n}")
    for rs in sweeps.values():
        mid = sorted(rs, key=lambda r: r["time_s"]["median"])[(len(rs) - 1) // 2]
        if cfg.repeats > 1:
            mid = {**mid, "sweep_medians_s": [r["time_s"]["median"] for r in rs]}
        doc["results"].append(mid)
    doc["env"]["collectives"] = collectives(doc)
    doc["notes"] = notes
    doc["env"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return doc


def collectives(doc: Dict[str, Any]) -> str:
    """The document's path: shared-memory if any row is; else its backend (a file without the
    field, from before shared memory, is Gloo's or NCCL's)."""
    paths = {r.get("collectives") for r in doc.get("results", [])}
    return "shared-memory" if "shared-memory" in paths else doc["env"]["backend"]


def table(doc: Dict[str, Any]) -> str:
    """One line per (op, W, size): median latency, spread, algbw, busbw."""
    lines = [f"{'op':<15}{'W':>3}{'size':>8}{'median us':>12}{'min-max us':>20}{'algbw GB/s':>12}"
             f"{'busbw GB/s':>12}{'n':>4}  path"]
    for r in doc["results"]:
        t = r["time_s"]
        spread = f"{t['min'] * 1e6:.1f}-{t['max'] * 1e6:.1f}"
        lines.append(f"{r['op']:<15}{r['world_size']:>3}{format_size(r['bytes']):>8}{t['median'] * 1e6:>12.1f}"
                     f"{spread:>20}{r['algbw_GBps']:>12.3f}"
                     f"{r['busbw_GBps']:>12.3f}{t['n']:>4}  {r.get('collectives', doc['env']['backend'])}")
    return "\n".join(lines)


def plot(doc: Dict[str, Any], path: str) -> Optional[str]:
    """Latency and busbw against size, one panel row per op, one line per W (busbw: W >= 2);
    None without matplotlib."""
    plt = try_pyplot()
    if plt is None:
        return None
    ops = [o for o in OPS if any(r["op"] == o for r in doc["results"])]
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 2.8 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for w in sorted({r["world_size"] for r in doc["results"] if r["op"] == op}):
            rs = sorted((r for r in doc["results"] if r["op"] == op and r["world_size"] == w),
                        key=lambda r: r["bytes"])
            x = [r["bytes"] for r in rs]
            med = [r["time_s"]["median"] * 1e6 for r in rs]
            lo = [r["time_s"]["p25"] * 1e6 for r in rs]
            hi = [r["time_s"]["p75"] * 1e6 for r in rs]
            line, = axes[i][0].plot(x, med, marker="o", ms=3, label=f"W={w}")
            axes[i][0].fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
            if w > 1:  # one rank moves nothing over a link: its "busbw" is a memory copy, off the scale
                axes[i][1].plot(x, [r["busbw_GBps"] for r in rs], marker="o", ms=3, color=line.get_color(),
                                label=f"W={w}")
        axes[i][0].set(xscale="log", yscale="log", ylabel=f"{op}\nlatency (us)")
        axes[i][1].set(xscale="log", ylabel="busbw (GB/s)")
        for ax in axes[i]:
            ax.grid(True, which="both", alpha=0.3)
        axes[i][0].legend(fontsize=7)
    axes[-1][0].set_xlabel("message size (bytes, nccl-tests convention)")
    axes[-1][1].set_xlabel("message size (bytes, nccl-tests convention)")
    e = doc["env"]
    fig.suptitle(f"bench comm: {e.get('collectives', e['backend'])} on {e['device']} (torch {e['torch_version']}, {e['date'][:10]})"
                 "\nmedian latency, band = quartiles", fontsize=10)
    return safe_write.finish_figure(fig, path, dpi=110)  # whole or as it was


# --- command line ------------------------------------------------------------------------------



def config_from_args(ns) -> CommConfig:
    if ns.workers is None:
        n = torch.cuda.device_count() if ns.backend == "nccl" and torch.cuda.is_available() else 0
        workers = list(range(1, max(n, 1) + 1)) if ns.backend == "nccl" else [2, 3, 4]
    else:
        workers = parse_int_list(ns.workers, flag="--workers")
    if ns.sizes:
        sizes = [parse_size(s) for s in ns.sizes.split(",") if s.strip()]
    else:
        lo, hi = parse_size(ns.min_size, flag="--min-size"), parse_size(ns.max_size, flag="--max-size")
        if ns.size_factor < 2:
            raise BadInput(f"--size-factor {ns.size_factor}: must be at least 2")
        if hi < lo:
            raise BadInput(f"--max-size {ns.max_size}: smaller than --min-size {ns.min_size}")
        sizes = default_sizes(lo, hi, ns.size_factor)
    if not (0 <= ns.compute_ms <= 10_000):
        raise BadInput(f"--compute-ms {ns.compute_ms}: expected 0 to 10000 ms")
    for flag, v in (("--warmup", ns.warmup), ("--iters", ns.iters), ("--min-iters", ns.min_iters)):
        if v < (0 if flag == "--warmup" else 1):
            raise BadInput(f"{flag} {v}: must be {'>= 0' if flag == '--warmup' else '>= 1'}")
    return CommConfig(backend=ns.backend, workers=workers, ops=[o for o in ns.ops.split(",") if o],
                      sizes=sizes, dtype=ns.dtype, warmup=ns.warmup, iters=ns.iters,
                      min_iters=min(ns.min_iters, ns.iters), budget_s=ns.budget_s, compute_ms=ns.compute_ms,
                      shared_memory=ns.shared_memory, repeats=ns.repeats)


def cmd_comm(ns) -> int:
    cfg = config_from_args(ns)
    doc = run(cfg)
    with safe_write.cli_output("bench comm"):  # a full disk, a read-only folder: one line, the measurement named
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        safe_write.write_json(ns.out, doc, indent=1)
    print(table(doc))
    print(f"wrote {ns.out}")
    if not ns.no_plot:
        with safe_write.cli_output("bench comm"):
            png = plot(doc, ns.plot or os.path.splitext(ns.out)[0] + ".png")
        print(f"wrote {png}" if png else "no plot: matplotlib is not installed")
    return 0
