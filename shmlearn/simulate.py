"""`shmlearn simulate`: predict step time, samples/s and scaling efficiency at 1..1024 workers
from measured compute and communication costs, and check the prediction against measured runs.

Communication: alpha-beta (Hockney) model per collective and backend, fitted to `bench comm`
JSON. A collective of S bytes (nccl-tests size convention) on W ranks takes

    t = alpha * L(W) + B(W, S) / bw

where L is the number of sequential message steps and B the bytes the busiest link carries, fixed
by the algorithm's form:

    form       L(W)              B(W, S)                 used for
    ring       2(W-1) | W-1      2(W-1)/W S | (W-1)/W S  all_reduce | all_gather, reduce_scatter
    flat       W-1               (W-1)/W S  (gather)     the root talks to every rank in turn:
                                 (W-1) S    (broadcast,  a parameter server's link
                                             reduce)
    tree       ceil(log2 W)      as flat (gather),       binomial tree
                                 ceil(log2 W) S (bcast)
               2 ceil(log2 W)    2(W-1)/W S (all_reduce) double binary tree (NCCL at scale)
    pipelined  W-1               S                       chunked chain (NCCL broadcast/reduce)

alpha (seconds per step) and bw (bytes/s on the link) are fitted by least squares on the
relative error, sum(((pred - t) / t)^2), which is linear in (alpha, 1/bw) and weighs a 4 KB
point as much as a 256 MB one (an absolute fit would ignore every small message); both are kept
>= 0. Every form listed for an op is fitted and the best (lowest RMS relative error) is reported,
which is how the paper's Fig. 6.5-6.6 puzzle is read off our own data (docs/scaling.md).

Compute: from a one-worker shmlearn run (summary.json: phase_s data, compute, update, and the
rest of wall_time_s / steps as `other`) or a throughput JSON {device, model, batch_size, step_s
or samples_per_s, optional phase_s, optional concurrent: [{processes, step_s, phase_s}]}.
`concurrent` holds CPU measurements of one worker's step while P independent one-worker
processes compute at once (no communication): processes on one machine share cores, caches and
memory bandwidth, and that is a property of the compute, not of the network. Beyond the largest
measured P, workers that outnumber the compute slots (`--slots`, e.g. 2 cores) are slowed by
P / max(P measured, slots). On GPUs (one per worker) there is nothing to share.

Strategies (per-worker batch B fixed, as shmlearn's --batch-size is; S = 4 x parameters):
    allreduce       c(data + compute + other + update) + ctl + allreduce(S)
    ps              c(data + compute + other) + ctl + gather(W S) + average(W rows) + update
                    + broadcast(S); gather and broadcast in the flat form: the server's link
                    carries (W-1) gradients in and (W-1) weight copies out per step
    ps-dedicated    as ps with W+1 processes: W workers, and a server that only serves
    weight-avg      c(data + compute + other + update) + ctl + allreduce(S) / K
    ddp             c(data + compute + other + update) + ctl
                    + max(allreduce(last 25 MB bucket), allreduce(S) - 2/3 c compute)
                    (backward, ~2/3 of compute, hides the all-reduce; not validated here)
Each step's first collective after the compute phase (ps: the gather; the others: the
all-reduce) also pays `wake(op, W)` (W computing ranks; weight-avg: wake / K) when
`--comm-after-compute FILE` is given: a second `bench comm` JSON measured with `--compute-ms T` (T ms of computation on every rank before each call, then the
barrier), against which the back-to-back --comm JSON is compared point by point. wake(op, W) =
the median over the sizes measured at W of (after-compute - back-to-back); between and
beyond the measured W, a least-squares line in W - 1 through them (wake(1) = 0). It is not a
property of the links: on a CPU whose cores the ranks share, a collective right after compute
waits for the ranks' communication threads to be scheduled again (2 Gloo ranks on 2 cores: several
times slower after compute than back to back), and a back-to-back fit alone under-predicts a
CPU run's step (the numbers: docs/scaling.md). Without
the file wake is 0, as for GPUs, where no such cost was seen.
all_reduce is the fitted ring unless --allreduce-algo tree (same alpha and bw, log-depth latency:
a what-if for W far beyond the measured, where NCCL leaves the ring).
ctl is the training loop's control all-reduce of 8(KP+2) bytes (P processes), paid once per K
steps: K = train's --check-every (1 in the classic loop; by default 10 on CPU and 50 on CUDA
for the strategies with a fast step, 1 for ddp); c() is
the compute of one worker while W workers compute (see Compute). Scaling efficiency = samples/s at W / (W x samples/s of one worker).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from shmlearn.errors import BadInput
from shmlearn.sync import registry
from shmlearn.sync.registry import Costs

FORMS = {
    "all_reduce": ("ring", "tree"),
    "reduce_scatter": ("ring",),
    "all_gather": ("ring",),
    "gather": ("flat", "tree"),
    "broadcast": ("flat", "tree", "pipelined"),
    "reduce": ("flat", "tree", "pipelined"),
}
ROOTED = ("broadcast", "reduce")


def _log2c(w: float) -> float:
    return float(math.ceil(math.log2(w))) if w > 1 else 0.0


def steps_and_bytes(op: str, form: str, w: float, size: float) -> Tuple[float, float]:
    """(L, B): sequential message steps and bytes on the busiest link, for `size` bytes in the
    nccl-tests convention (see the module docstring)."""
    if w <= 1:
        return 0.0, 0.0
    if form == "ring":
        k = 2.0 if op == "all_reduce" else 1.0
        return k * (w - 1), k * (w - 1) / w * size
    if form == "flat":
        return w - 1, (w - 1) * size if op in ROOTED else (w - 1) / w * size
    if form == "tree":
        if op == "all_reduce":  # NCCL's double binary tree: reduce up, broadcast down, pipelined
            return 2 * _log2c(w), 2 * (w - 1) / w * size
        return _log2c(w), _log2c(w) * size if op in ROOTED else (w - 1) / w * size
    if form == "pipelined":
        return w - 1, size
    raise ValueError(f"unknown form {form}")


# --- the alpha-beta fit ----------------------------------------------------------------------

@dataclass
class Fit:
    op: str
    form: str
    alpha_s: float
    """Seconds per sequential message step (latency)."""
    bw_Bps: float
    """Bytes per second on the busiest link (inf if the data showed no size dependence)."""
    rms_rel_err: float
    max_rel_err: float
    points: int

    def time(self, w: float, size: float) -> float:
        steps, nbytes = steps_and_bytes(self.op, self.form, w, size)
        return self.alpha_s * steps + (nbytes / self.bw_Bps if self.bw_Bps != math.inf else 0.0)


def fit_alpha_beta(op: str, form: str, points: Sequence[Tuple[int, float, float]]) -> Fit:
    """Least squares on the relative error over points (W, size_bytes, seconds), W >= 2.

    Minimizes sum(((alpha L + B / bw) - t)^2 / t^2) with alpha, 1/bw >= 0: a linear problem in
    (alpha, 1/bw) with rows scaled by 1/t. A coefficient that comes out negative is pinned at
    zero and the other refitted (the non-negative solution of a two-variable problem)."""
    pts = [(w, s, t) for w, s, t in points if w >= 2 and t > 0]
    if len(pts) < 2:
        raise BadInput(f"{op}: the comm JSON has {len(pts)} points with W >= 2; the fit needs 2")
    A = np.array([steps_and_bytes(op, form, w, s) for w, s, _ in pts], dtype=np.float64)
    t = np.array([p[2] for p in pts], dtype=np.float64)
    Aw, tw = A / t[:, None], np.ones_like(t)
    coef = np.linalg.lstsq(Aw, tw, rcond=None)[0]
    if coef[0] < 0 or coef[1] < 0:
        cands = []
        for j in (0, 1):
            c = np.zeros(2)
            col = Aw[:, j]
            c[j] = max(0.0, float(col @ tw / (col @ col))) if col @ col > 0 else 0.0
            cands.append((float(np.sum((Aw @ c - tw) ** 2)), c))
        coef = min(cands, key=lambda x: x[0])[1]
    rel = (A @ coef - t) / t
    return Fit(op=op, form=form, alpha_s=float(coef[0]), bw_Bps=1.0 / coef[1] if coef[1] > 0 else math.inf,
               rms_rel_err=float(np.sqrt(np.mean(rel ** 2))), max_rel_err=float(np.max(np.abs(rel))),
               points=len(pts))


def fit_comm(doc: Dict[str, Any], *, min_bytes: int = 0) -> Dict[str, Dict[str, Fit]]:
    """Every op in a bench comm JSON, every form of FORMS[op]: {op: {form: Fit}}."""
    by_op: Dict[str, List[Tuple[int, float, float]]] = {}
    for r in doc["results"]:
        if r["bytes"] >= min_bytes:
            by_op.setdefault(r["op"], []).append((r["world_size"], float(r["bytes"]), r["time_s"]["median"]))
    fits = {}
    for op, pts in by_op.items():
        if sum(1 for w, _, _ in pts if w >= 2) >= 2:
            fits[op] = {form: fit_alpha_beta(op, form, pts) for form in FORMS.get(op, ("ring",))}
    return fits


def best_form(fits: Dict[str, Fit]) -> Fit:
    return min(fits.values(), key=lambda f: f.rms_rel_err)


# --- the after-compute cost -------------------------------------------------------------------

@dataclass
class Wake:
    """wake(op, W): seconds a collective costs beyond its back-to-back time when it follows a
    compute phase (the module docstring), from two bench comm JSONs of the same machine."""

    by_op: Dict[str, Dict[int, float]]
    """Measured: {op: {W: the median over sizes of the excess (s)}}."""
    slope_s: Dict[str, float]
    """{op: least-squares wake per extra rank through its measured points}: wake = slope (W - 1)."""
    compute_ms: float
    points: int
    source: str

    def __call__(self, op: str, w: float) -> float:
        if w <= 1:
            return 0.0
        if op not in self.by_op:  # not measured: the median over the ops that were
            return float(np.median([self(o, w) for o in self.by_op]))
        return self.by_op[op].get(int(w), self.slope_s[op] * (w - 1))

    @classmethod
    def from_comm(cls, back: Dict[str, Any], after: Dict[str, Any], source: str) -> "Wake":
        ms = float((after.get("config") or {}).get("compute_ms") or 0.0)
        if ms <= 0:
            raise BadInput(f"--comm-after-compute {source}: not measured with bench comm --compute-ms T > 0")
        b2b = {(r["op"], r["world_size"], r["bytes"]): r["time_s"]["median"] for r in back["results"]}
        excess: Dict[str, Dict[int, List[float]]] = {}
        for r in after["results"]:
            k = (r["op"], r["world_size"], r["bytes"])
            if r["world_size"] >= 2 and k in b2b:
                excess.setdefault(r["op"], {}).setdefault(r["world_size"], []).append(r["time_s"]["median"] - b2b[k])
        if not excess:
            raise BadInput(f"--comm-after-compute {source}: no (op, W >= 2, size) point in common with --comm")
        by_op, slope = {}, {}
        for op, per_w in excess.items():
            by_op[op] = {w: max(0.0, float(np.median(v))) for w, v in sorted(per_w.items())}
            x = np.array([w - 1.0 for w in by_op[op]])
            slope[op] = float(x @ np.array(list(by_op[op].values())) / (x @ x))
        return cls(by_op=by_op, slope_s=slope, compute_ms=ms, source=source,
                   points=sum(len(v) for per_w in excess.values() for v in per_w.values()))


# --- inputs: network and compute --------------------------------------------------------------

@dataclass
class Network:
    """The three collectives the strategies use, each a Fit (fitted, or given as assumptions)."""

    name: str
    all_reduce: Fit
    gather: Fit
    broadcast: Fit
    source: str

    @classmethod
    def from_comm(cls, doc: Dict[str, Any], source: str) -> "Network":
        fits = fit_comm(doc)
        missing = [op for op in ("all_reduce", "gather", "broadcast") if op not in fits]
        if missing:
            raise BadInput(f"--comm {source}: no {', '.join(missing)} points with W >= 2 to fit")
        e = doc["env"]
        return cls(name=f"{e['backend']} on {e['device']}", all_reduce=fits["all_reduce"]["ring"],
                   gather=fits["gather"]["flat"], broadcast=fits["broadcast"]["flat"], source=source)

    @classmethod
    def assumed(cls, bw_GBps: float, latency_us: float, name: str) -> "Network":
        a, bw = latency_us * 1e-6, bw_GBps * 1e9
        mk = lambda op, form: Fit(op, form, a, bw, float("nan"), float("nan"), 0)  # noqa: E731
        return cls(name=name, all_reduce=mk("all_reduce", "ring"), gather=mk("gather", "flat"),
                   broadcast=mk("broadcast", "flat"), source=f"assumed: {bw_GBps} GB/s per link, "
                                                            f"{latency_us} us per message step")


DATASET_SHAPES = {  # (C, H, W), classes: what model sizes depend on (no files are read)
    "synthetic": ((3, 32, 32), 10), "cifar10": ((3, 32, 32), 10), "mnist": ((1, 28, 28), 10),
    "fashion-mnist": ((1, 28, 28), 10), "tiny-imagenet": ((3, 64, 64), 200), "digits": ((1, 8, 8), 10),
}


def parameter_count(model: str, dataset: str = "synthetic", input_shape=None, classes=None) -> int:
    from shmlearn.data.base import DataSpec
    from shmlearn.models import build_model
    shape, n = DATASET_SHAPES.get(dataset, ((3, 32, 32), 10))
    spec = DataSpec(name=dataset, task="classification", input_shape=tuple(input_shape or shape),
                    num_outputs=int(classes or n))
    return sum(p.numel() for p in build_model(model, spec).parameters() if p.requires_grad)


@dataclass
class Compute:
    """Seconds per step of one worker at batch_size, by part; parameters of the model."""

    data_s: float
    compute_s: float
    update_s: float
    other_s: float
    batch_size: int
    parameters: int
    model: str
    device: str
    source: str
    concurrent: Dict[int, Dict[str, float]] = field(default_factory=dict)
    """CPU: {P: the same parts, measured while P one-worker processes compute at once}."""

    @property
    def step_s(self) -> float:
        return self.data_s + self.compute_s + self.update_s + self.other_s

    def parts(self, procs: int, slots: Optional[float]) -> Dict[str, float]:
        """data, compute, update, other of one worker while `procs` workers compute at once: the
        measurement at procs if there is one, else the nearest below, slowed by procs / slots
        once the workers outnumber the compute slots."""
        measured = {1: {"data": self.data_s, "compute": self.compute_s, "update": self.update_s,
                        "other": self.other_s}, **self.concurrent}
        p0 = max(p for p in measured if p <= max(procs, 1))
        k = 1.0 if slots is None else max(1.0, procs / max(p0, slots))
        return {name: k * v for name, v in measured[p0].items()}


def _bench_strategies() -> List[str]:
    """The variants of a `bench throughput` JSON that are shmlearn strategies (its baselines are
    not; bench times those with a fast step and no server rank)."""
    return registry.names(fast_step=True, servers=0)


def _variant_strategy(variant: str) -> str:
    """A bench variant's strategy: 'allreduce:compile' (a strategy with bench modifiers) -> 'allreduce'."""
    return variant.split(":")[0]


def _bench_row(r: Dict[str, Any], doc: Dict[str, Any]) -> Dict[str, Any]:
    """A `bench throughput` result row in the shape of a measured run / compute source."""
    c = doc["config"]
    entry = registry.get(_variant_strategy(r["variant"]), "--measured: variant")
    spec = entry.spec(entry.params_from(c))  # the bench's settings, named as TrainConfig names them
    return {"name": f"{c['model']} {r['variant']} W={r['workers']} B={r['batch']} ({r['mode']})",
            "status": "completed", "steps": 1, "strategy": _variant_strategy(r["variant"]), "workers": r["workers"],
            "batch_size": r["batch"], "model": c["model"], "device": doc["env"].get("device", "?"),
            "input_shape": c.get("input_shape"), "classes": c.get("classes"),
            "strategy_params": spec.as_dict(), "avg_period": spec.period(),
            "check_every": 1 if str(r.get("mode", "")).startswith("classic") else None,
            "step_s": 1.0 / r["steps_per_s"]["median"]}


def throughput_compute(doc: Dict[str, Any], batch: Optional[int], source: str) -> Dict[str, Any]:
    """The one-worker shmlearn step of a `bench throughput` JSON at `batch` (default: the
    smallest batch): the compute source, with no communication in it."""
    rows = [r for r in doc["results"] if r["workers"] == 1 and _variant_strategy(r["variant"]) in _bench_strategies()]
    batches = sorted({r["batch"] for r in rows})
    if not rows:
        raise BadInput(f"--compute {source}: no one-worker shmlearn row (run bench throughput with --workers 1,...)")
    b = batch if batch is not None else batches[0]
    pick = [r for r in rows if r["batch"] == b]
    if not pick:
        raise BadInput(f"--batch {b}: {source} has one-worker rows for batch {', '.join(map(str, batches))}")
    return _bench_row(pick[0], doc)


def _read_json(flag: str, path: str) -> Dict[str, Any]:
    """A flag's JSON file (or a run directory's summary.json), or BadInput naming the flag."""
    f = os.path.join(path, "summary.json") if os.path.isdir(path) else path
    try:
        with open(f) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise BadInput(f"{flag} {path}: cannot read a JSON file ({e})") from None


def load_compute(path: str, batch: Optional[int] = None) -> Compute:
    """A run directory or its summary.json (one worker), a throughput JSON, or a `bench
    throughput` JSON (its one-worker row at `batch`)."""
    d = _read_json("--compute", path)
    if d.get("benchmark") == "throughput" and "results" in d:
        d = throughput_compute(d, batch, path)
    model = d.get("model")
    batch = d.get("batch_size") or d.get("batch")
    if not model or not batch:
        raise BadInput(f"--compute {path}: needs 'model' and 'batch_size' (a shmlearn summary.json "
                       "or a throughput JSON {device, model, batch_size, step_s or samples_per_s})")
    params = d.get("parameters") or parameter_count(model, d.get("dataset", "synthetic"),
                                                    d.get("input_shape"), d.get("classes"))
    ph = d.get("phase_s") or {}
    if "step_s" in d:  # a throughput JSON (or a measured bundle's entry)
        step = d["step_s"]
    elif "wall_time_s" in d and "steps" in d:  # a shmlearn run
        if d.get("workers", 1) != 1:
            raise BadInput(f"--compute {path}: a run of {d['workers']} workers; the compute source must be "
                           "a one-worker run (its step has no communication to subtract)")
        step = d["wall_time_s"] / d["steps"]
    elif "samples_per_s" in d:
        step = batch / d["samples_per_s"]
    else:
        raise BadInput(f"--compute {path}: has neither wall_time_s/steps, step_s nor samples_per_s")
    def split(ph: Dict[str, float], step: float) -> Dict[str, float]:
        data, comp, upd = ph.get("data", 0.0), ph.get("compute", step if not ph else 0.0), ph.get("update", 0.0)
        return {"data": data, "compute": comp, "update": upd, "other": max(0.0, step - data - comp - upd)}

    def slowest(e: Dict[str, Any]) -> Dict[str, float]:
        # A synchronous step ends when the slowest worker arrives: P processes on fewer cores do
        # not share them evenly (3 on 2 cores: one clearly slower than the other two;
        # docs/performance.md), so the kept try's slowest process sets the compute, its phases
        # scaled from the median process's.
        parts = split(e.get("phase_s") or {}, e["step_s"])
        per = next((t.get("per_process_step_s") for t in e.get("tries", [])
                    if abs(t.get("step_s", -1) - e["step_s"]) < 1e-12), None)
        if per:
            k = max(per) / e["step_s"]
            parts = {name: v * k for name, v in parts.items()}
        return parts

    one = split(ph, step)
    conc = {int(e["processes"]): slowest(e) for e in d.get("concurrent", []) if int(e["processes"]) > 1}
    return Compute(data_s=one["data"], compute_s=one["compute"], update_s=one["update"], other_s=one["other"],
                   batch_size=int(batch), parameters=int(params), model=model, device=d.get("device", "?"),
                   source=path, concurrent=conc)


# --- the predictor ------------------------------------------------------------------------------

def strategies() -> List[str]:
    """The names simulate predicts: every registered strategy's variants (ps and ps-dedicated)."""
    return list(registry.sim_variants())


def default_strategies() -> List[str]:
    """What simulate predicts unless told: the strategies with a fast step and no server rank
    (allreduce, ps, weight-avg); the others when named."""
    return registry.names(fast_step=True, servers=0)


def _period(name: str, params) -> int:
    """Steps per communication round of a strategy with these parameters (1: every step)."""
    return _entry(name).spec(params).period()


def _entry(name: str):
    """The registry entry of a simulate name (BadInput naming --strategies if there is none)."""
    variants = registry.sim_variants()
    if name not in variants:
        raise BadInput(f"--strategies {name}: choose from {', '.join(variants)}")
    return variants[name][0]


def _variant(name: str, m: "Machine", params=None):
    """(entry, parameters) of a simulate name: `params` if given (a measured run's), else the
    variant's fixed parameters over the Machine's settings (--avg-period)."""
    entry = _entry(name)
    if params is None:
        params = replace(entry.params_from({"avg_period": m.avg_period}), **registry.sim_variants()[name][1])
    return entry, params


@dataclass(kw_only=True)
class Machine:
    compute: Compute
    net: Network
    slots: Optional[float] = None
    """Compute units the workers share (CPU cores at one thread each); None: one per worker."""
    avg_bps: Optional[float] = None
    """Bytes/s of the server's averaging (rows x bytes / time); None: from the update phase."""
    avg_alpha_s: float = 0.0
    avg_period: int = 1
    check_every: Optional[int] = None
    """Steps per control all-reduce (losses, requests): 1 in the classic loop, K in the fast
    step (train's `--check-every`), where it is paid once per K steps. None: what `train` does by
    default (`control_period`)."""
    bwd_frac: float = 2 / 3
    wake: Optional["Wake"] = None
    """The after-compute cost of a step's first collective (None: 0)."""
    allreduce_algo: str = "ring"
    """ring (what the fits measured) or tree: the same alpha and bw, 2 log2(W) latency steps
    instead of 2(W-1) (NCCL switches to trees at scale; a what-if beyond the measured W)."""


def control_period(m: Machine, strategy: str) -> int:
    """Steps per control all-reduce: m.check_every if given, else train's default on the compute
    source's device (fast.DEFAULT_CHECK_EVERY) for strategies with a fast step, and 1 (the
    classic loop) for the rest. Assumes an SGD-family optimizer, as the validation runs use."""
    if m.check_every is not None:
        return m.check_every
    from shmlearn.fast import DEFAULT_CHECK_EVERY
    if not _variant(strategy, m)[0].fast_step:
        return 1
    return DEFAULT_CHECK_EVERY["cpu" if str(m.compute.device).lower().startswith("cpu") else "cuda"]


def average_s(m: Machine, rows: int, nbytes: float) -> float:
    if m.avg_bps:
        return m.avg_alpha_s + rows * nbytes / m.avg_bps
    # No measurement: an SGD-momentum update makes ~5 passes over the weights, a mean of R rows
    # R + 1 passes, so scale the measured update by (R + 1) / 5.
    return m.compute.update_s * (rows + 1) / 5


def predict(m: Machine, strategy: str, w: int, params=None) -> Dict[str, float]:
    """Seconds per step by part for `w` workers; 'step_s' is their sum. The strategy's own parts
    come from its cost model (its registry entry); params: a measured run's parameters."""
    entry, params, costs = _costs(m, strategy, w, params)
    parts = {"data": costs.local["data"], "compute": costs.local["compute"], "other": costs.local["other"]}
    k = control_period(m, strategy)
    parts["control"] = costs.all_reduce(costs.processes, 8.0 * (k * costs.processes + 2)) / k \
        if costs.processes > 1 else 0.0
    parts.update(entry.cost(costs, params))
    parts["step_s"] = sum(parts.values())
    return parts


def predict_more(m: Machine, strategy: str, w: int, params=None, slow=None) -> Dict[str, Any]:
    """What the strategy predicts besides time per step ({} for most; async-ps: each worker's
    staleness histogram), slow = (rank, k): that worker computes k times slower."""
    entry, params, costs = _costs(m, strategy, w, params)
    return entry.predict_more(costs, params, slow=slow) if entry.predict_more else {}


def _costs(m: Machine, strategy: str, w: int, params=None):
    entry, params = _variant(strategy, m, params)
    c = m.compute
    S = 4.0 * c.parameters
    allreduce = m.net.all_reduce if m.allreduce_algo == "ring" else replace(m.net.all_reduce, form="tree")
    procs = entry.spec(params).processes(w)
    local = c.parts(w, m.slots)  # w processes compute at once (a dedicated server waits meanwhile)
    # The computing ranks set the wake (a server only waits): wake(op, W), W not the processes.
    wake = (lambda op: m.wake(op, w)) if m.wake is not None and procs > 1 else (lambda op: 0.0)
    costs = Costs(workers=w, processes=procs, grad_bytes=S, local=local, update_s=c.update_s,
                  all_reduce=allreduce.time, gather=m.net.gather.time, broadcast=m.net.broadcast.time,
                  average=lambda rows, nbytes: average_s(m, rows, nbytes), wake=wake, bwd_frac=m.bwd_frac)
    return entry, params, costs


def scaling_table(m: Machine, strategies: Sequence[str], workers: Sequence[int]) -> List[Dict[str, Any]]:
    base = predict(m, registry.DEFAULT, 1)["step_s"]  # one worker, no communication
    rows = []
    for s in strategies:
        for w in workers:
            p = predict(m, s, w)
            sps = w * m.compute.batch_size / p["step_s"]
            rows.append({"strategy": s, "workers": w, "step_s": p["step_s"], "samples_per_s": sps,
                         "efficiency": sps / (w * m.compute.batch_size / base), "parts": p})
    return rows


# --- measured points ----------------------------------------------------------------------------

def _strategy_of(s: Dict[str, Any], run_dir: Optional[str]) -> Tuple[str, Any]:
    """(simulate name, parameters) of a measured run, from its summary's `strategy_params`.
    A summary from before them: the TrainConfig-named keys a bundle kept (avg_period) over its
    run's config.yaml, with as many serving ranks as it had processes beyond its workers."""
    entry = registry.get(s.get("strategy"), "--measured: strategy")
    recorded = s.get("strategy_params", (s.get("summary") or {}).get("strategy_params"))  # a bundle keeps the summary
    if recorded is not None:
        params = entry.params_of(recorded)
    else:
        values = {}
        if run_dir and os.path.exists(os.path.join(run_dir, "config.yaml")):
            import yaml
            with open(os.path.join(run_dir, "config.yaml")) as f:
                values = yaml.safe_load(f) or {}
        values.update(s)
        servers = s.get("processes", s["workers"]) - s["workers"]
        params = registry.with_servers(entry, entry.params_from(values), servers)
    return registry.sim_name(entry, params), params


def load_measured(paths: Iterable[str]) -> List[Dict[str, Any]]:
    """Measured runs: run directories, summary.json files, or bundles {"runs": [summary, ...]}."""
    out = []
    for p in paths:
        d = _read_json("--measured", p)
        if d.get("benchmark") == "throughput" and "results" in d:  # bench throughput: its shmlearn rows
            runs = [_bench_row(r, d) for r in d["results"]
                    if r["workers"] > 1 and _variant_strategy(r["variant"]) in _bench_strategies()]
        else:
            runs = d["runs"] if "runs" in d else [d]
        for s in runs:
            if s.get("status", "completed") != "completed" or not s.get("steps"):
                continue
            # The loop the run used: a run records it since the fast step exists (older runs were
            # classic: 1); a bench throughput row records only its mode (None: the Machine's).
            ce = s.get("check_every", (s.get("summary") or {}).get("check_every"))
            if ce is None and ("summary" in s or "wall_time_s" in s):
                ce = 1
            name, params = _strategy_of(s, p if os.path.isdir(p) else None)
            out.append({"name": s.get("name", p), "strategy": name, "workers": s["workers"],
                        "check_every": int(ce) if ce else None,
                        "batch_size": s["batch_size"], "model": s.get("model"),
                        "strategy_params": asdict(params),
                        "avg_period": _period(name, params),
                        "step_s": s.get("step_s") or s["wall_time_s"] / s["steps"],
                        "phase_s": s.get("phase_s", {}),
                        "staleness_histogram": s.get("staleness_histogram")})
    return out


def validate(m: Machine, measured: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Predicted against measured step time for every measured multi-worker run of m's model."""
    rows = []
    for r in measured:
        if r["workers"] < 2 or (r["model"] and r["model"] != m.compute.model):
            continue
        if r["batch_size"] != m.compute.batch_size:
            continue  # the compute source's batch is the only one we measured the compute of
        # The measured run's own loop where it recorded one (a bench throughput row does not).
        ce = r.get("check_every") or m.check_every
        mm = Machine(**{**m.__dict__, "avg_period": r.get("avg_period", 1), "check_every": ce})
        params = None
        if r.get("strategy_params") is not None:
            params = _variant(r["strategy"], mm)[0].params_of(r["strategy_params"])
        p = predict(mm, r["strategy"], r["workers"], params)
        rows.append({"name": r["name"], "strategy": r["strategy"], "workers": r["workers"],
                     "avg_period": r.get("avg_period", 1), "check_every": control_period(mm, r["strategy"]),
                     "measured_step_s": r["step_s"],
                     "predicted_step_s": p["step_s"], "error": p["step_s"] / r["step_s"] - 1,
                     "parts": p, "measured_phase_s": r["phase_s"]})
        more = predict_more(mm, r["strategy"], r["workers"], params)
        if more:  # async-ps: the staleness histogram, predicted beside the run's
            rows[-1].update(predicted_more=more, measured_staleness_histogram=r.get("staleness_histogram"))
    return rows


# --- output ------------------------------------------------------------------------------------

def format_table(rows: List[Dict[str, Any]], strategies: Sequence[str], workers: Sequence[int]) -> str:
    head = f"{'W':>5} " + "".join(f"| {s:^28} " for s in strategies)
    sub = f"{'':>5} " + "".join(f"| {'step ms':>9} {'samples/s':>10} {'eff':>5} " for _ in strategies)
    lines = [head, sub]
    idx = {(r["strategy"], r["workers"]): r for r in rows}
    for w in workers:
        cells = []
        for s in strategies:
            r = idx[(s, w)]
            cells.append(f"| {r['step_s'] * 1e3:>9.2f} {r['samples_per_s']:>10.0f} {r['efficiency']:>5.2f} ")
        lines.append(f"{w:>5} " + "".join(cells))
    return "\n".join(lines)


def format_validation(rows: List[Dict[str, Any]]) -> str:
    lines = [f"{'run':<44}{'measured ms':>12}{'predicted ms':>13}{'error':>8}"]
    for r in rows:
        lines.append(f"{r['name']:<44}{r['measured_step_s'] * 1e3:>12.2f}{r['predicted_step_s'] * 1e3:>13.2f}"
                     f"{r['error'] * 100:>7.1f}%")
    return "\n".join(lines)


def plot(doc: Dict[str, Any], path: str) -> Optional[str]:
    from shmlearn.bench.common import try_pyplot
    plt = try_pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {}
    for s in doc["strategies"]:
        rs = [r for r in doc["predictions"] if r["strategy"] == s]
        ws = [r["workers"] for r in rs]
        label = f"{s} (K={doc['avg_period']})" if _entry(s).rounds else s
        line, = axes[0].plot(ws, [r["step_s"] * 1e3 for r in rs], label=label)
        colors[s] = line.get_color()
        axes[1].plot(ws, [r["samples_per_s"] for r in rs], color=colors[s], label=label)
        axes[2].plot(ws, [r["efficiency"] for r in rs], color=colors[s], label=label)
    for v in doc.get("validation", []):
        col = colors.get(v["strategy"], "k")
        axes[0].plot(v["workers"], v["measured_step_s"] * 1e3, "o", color=col, mfc="none")
        sps = v["workers"] * doc["compute"]["batch_size"] / v["measured_step_s"]
        axes[1].plot(v["workers"], sps, "o", color=col, mfc="none")
    if doc.get("validation"):
        axes[0].plot([], [], "ko", mfc="none", label="measured")
    axes[0].set(xscale="log", yscale="log", xlabel="workers", ylabel="step time (ms)")
    axes[1].set(xscale="log", yscale="log", xlabel="workers", ylabel="samples/s")
    axes[2].set(xscale="log", xlabel="workers", ylabel="scaling efficiency", ylim=(0, 1.05))
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    c = doc["compute"]
    fig.suptitle(f"simulate: {c['model']}, batch {c['batch_size']}/worker, compute on {c['device']}; "
                 f"network: {doc['network']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fit_dict(f: Fit) -> Dict[str, Any]:
    d = asdict(f)
    d["bw_GBps"] = f.bw_Bps / 1e9 if f.bw_Bps != math.inf else None
    d["alpha_us"] = f.alpha_s * 1e6
    del d["bw_Bps"]
    return d


def simulate(*, comm: Optional[str], compute: str, ps_sim: Optional[str] = None, net_bw: Optional[float] = None,
             net_latency_us: Optional[float] = None, net_name: Optional[str] = None,
             strategies: Optional[Sequence[str]] = None, workers: Sequence[int] = (),
             avg_period: int = 4, slots: Optional[float] = None, measured: Sequence[str] = (),
             allreduce_algo: str = "ring", check_every: Optional[int] = None, batch: Optional[int] = None,
             comm_after_compute: Optional[str] = None) -> Dict[str, Any]:
    """Fit, predict, validate: the JSON document the CLI writes."""
    comp = load_compute(compute, batch)
    all_fits, wake = {}, None
    if net_bw is not None:
        net = Network.assumed(net_bw, net_latency_us or 0.0, net_name or f"{net_bw} GB/s network")
    elif comm:
        doc = _read_json("--comm", comm)
        net = Network.from_comm(doc, comm)
        if comm_after_compute:
            wake = Wake.from_comm(doc, _read_json("--comm-after-compute", comm_after_compute), comm_after_compute)
        all_fits = {op: {form: _fit_dict(f) for form, f in fs.items()} for op, fs in fit_comm(doc).items()}
    else:
        raise BadInput("give --comm FILE.json (a bench comm result) or --net-bw GBPS [--net-latency-us US]")
    if comm_after_compute and not comm:
        raise BadInput("--comm-after-compute needs --comm: the back-to-back bench comm JSON it is compared with")
    if allreduce_algo not in ("ring", "tree"):
        raise BadInput(f"--allreduce-algo {allreduce_algo}: choose ring or tree")
    if check_every is not None and check_every < 1:
        raise BadInput(f"--check-every {check_every}: must be >= 1")
    m = Machine(compute=comp, net=net, slots=slots, avg_period=avg_period, allreduce_algo=allreduce_algo,
                check_every=check_every, wake=wake)
    avg_src = "estimated: update phase x (rows + 1) / 5"
    if ps_sim:
        ps = _read_json("--ps-sim", ps_sim)
        pts = [(r["workers"], ps["gradient_bytes"], r["stats"]["avg_s"]["median"]) for r in ps["results"]]
        if len({w for w, _, _ in pts}) < 2:
            raise BadInput(f"--ps-sim {ps_sim}: needs at least 2 worker counts to fit the averaging cost")
        x = np.array([[1.0, w * b] for w, b, _ in pts])
        t = np.array([p[2] for p in pts])
        coef = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)[0]
        m.avg_alpha_s, m.avg_bps = max(0.0, coef[0]), (1 / coef[1] if coef[1] > 0 else None)
        avg_src = f"fitted to {ps_sim} (gradient average vs workers)"
    workers = sorted(set(workers or [2 ** i for i in range(11)]))
    strategies = list(strategies) if strategies else default_strategies()
    for s in strategies:
        _variant(s, m)  # BadInput for an unknown name
    meas = load_measured(measured)
    workers = sorted(set(workers) | {r["workers"] for r in meas if r["model"] in (None, comp.model)})
    preds = scaling_table(m, strategies, workers)
    val = validate(m, meas)
    return {"schema": 1, "compute": asdict(comp), "network": {
                "name": net.name, "source": net.source,
                "used": {op: _fit_dict(getattr(net, op)) for op in ("all_reduce", "gather", "broadcast")},
                "all_fits": all_fits,
                "best_forms": {op: min(fs, key=lambda k: fs[k]["rms_rel_err"]) for op, fs in all_fits.items()},
                "fit_method": "least squares on relative error, alpha and 1/bw >= 0",
                "after_compute": None if wake is None else {
                    "source": wake.source, "compute_ms": wake.compute_ms, "points": wake.points,
                    "wake_s": {op: {str(w): v for w, v in per_w.items()} for op, per_w in wake.by_op.items()},
                    "slope_s_per_rank": wake.slope_s}},
            "slots": slots, "avg_period": avg_period, "allreduce_algo": allreduce_algo, "check_every": check_every,
            "check_every_used": {s: control_period(m, s) for s in strategies}, "averaging": avg_src, "strategies": list(strategies),
            "workers": workers, "predictions": preds, "validation": val}


# --- command line ------------------------------------------------------------------------------

def register(sub) -> None:
    p = sub.add_parser("simulate", help="predict step time and scaling to 1024 workers from measured costs",
                       description="Fit alpha-beta models to bench comm JSON, take compute time from a one-worker "
                                   "run or a throughput JSON, predict step time, samples/s and scaling "
                                   "efficiency per strategy, and compare with measured runs.")
    p.add_argument("--comm", help="bench comm JSON to fit (the network)")
    p.add_argument("--net-bw", type=float, help="instead of --comm: assumed link bandwidth, GB/s")
    p.add_argument("--net-latency-us", type=float, default=0.0, help="with --net-bw: latency per message step, us")
    p.add_argument("--net-name", help="with --net-bw: the network's name in the table and plot")
    p.add_argument("--comm-after-compute", default=None,
                   help="bench comm JSON of the same machine measured with --compute-ms T: the extra cost of a "
                        "step's first collective after its compute (needed on CPUs whose cores the ranks share)")
    p.add_argument("--compute", required=True,
                   help="one-worker shmlearn run directory (or its summary.json), or a throughput JSON")
    p.add_argument("--batch", type=int, default=None,
                   help="with a bench throughput JSON as --compute: the per-worker batch to take [smallest]")
    p.add_argument("--ps-sim", help="bench ps-sim JSON: the server's averaging cost (default: from the update phase)")
    p.add_argument("--strategies", default=",".join(default_strategies()),
                   help=f"comma list of {','.join(strategies())} [{','.join(default_strategies())}]")
    p.add_argument("--avg-period", type=int, default=4, help="weight-avg: average every K steps [4]")
    p.add_argument("--allreduce-algo", default="ring",
                   help="ring (as measured) or tree (2 log2 W latency steps: NCCL at scale, a what-if) [ring]")
    p.add_argument("--check-every", type=int, default=None,
                   help="steps per control all-reduce, as train's --check-every: 1 for the classic loop "
                        "[train's default on the compute's device: 10 on CPU, 50 on CUDA for allreduce, "
                        "ps and weight-avg; 1 for ddp]; a measured run is predicted with the value it ran with")
    p.add_argument("--workers", default=None, help="worker counts [1,2,4,...,1024]")
    p.add_argument("--slots", type=float, default=None,
                   help="compute units the workers share, e.g. 2 for 2 CPU cores [one per worker]")
    p.add_argument("--measured", nargs="*", default=[],
                   help="measured runs to compare: run directories, summary.json, or bundles {runs: [...]}")
    p.add_argument("--out", default="simulate", help="directory for simulate.json and simulate.png [simulate]")
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(ns) -> int:
    from shmlearn.bench.common import parse_int_list
    workers = parse_int_list(ns.workers, flag="--workers") if ns.workers else []
    if ns.avg_period < 1:
        raise BadInput(f"--avg-period {ns.avg_period}: must be >= 1")
    doc = simulate(comm=ns.comm, compute=ns.compute, ps_sim=ns.ps_sim, net_bw=ns.net_bw,
                   net_latency_us=ns.net_latency_us, net_name=ns.net_name,
                   strategies=[s for s in ns.strategies.split(",") if s], workers=workers,
                   avg_period=ns.avg_period, slots=ns.slots, measured=ns.measured,
                   allreduce_algo=ns.allreduce_algo, check_every=ns.check_every, batch=ns.batch,
                   comm_after_compute=ns.comm_after_compute)
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "simulate.json"), "w") as f:
        json.dump(doc, f, indent=1)
    n = doc["network"]
    print(f"network: {n['name']} ({n['source']})")
    for op, f in n["used"].items():
        bw = f"{f['bw_GBps']:.3f} GB/s" if f["bw_GBps"] else "inf"
        fit = f", fit RMS rel. error {f['rms_rel_err'] * 100:.1f}% over {f['points']} points" if f["points"] else ""
        print(f"  {op:<10} {f['form']:<5} alpha {f['alpha_us']:.1f} us/step, bw {bw}{fit}")
    if n["after_compute"]:
        a = n["after_compute"]
        per_op = [f"{op} " + ", ".join(f"W={w} +{v * 1e3:.2f} ms" for w, v in a["wake_s"][op].items())
                  for op in ("all_reduce", "gather") if op in a["wake_s"]]
        print(f"  after {a['compute_ms']:g} ms of compute ({a['points']} points), a step's first collective "
              f"costs more: {'; '.join(per_op)}")
    c = doc["compute"]
    print(f"compute: {c['model']}, batch {c['batch_size']}, {c['device']}: data {c['data_s'] * 1e3:.2f} + compute "
          f"{c['compute_s'] * 1e3:.2f} + update {c['update_s'] * 1e3:.2f} + other {c['other_s'] * 1e3:.2f} ms/step; "
          f"{c['parameters']} parameters")
    print(format_table(doc["predictions"], doc["strategies"], doc["workers"]))
    if doc["validation"]:
        print(format_validation(doc["validation"]))
    print(f"wrote {os.path.join(ns.out, 'simulate.json')}")
    png = plot(doc, os.path.join(ns.out, "simulate.png"))
    print(f"wrote {png}" if png else "no plot: matplotlib is not installed")
    return 0
