"""simulate's network: the alpha-beta (Hockney) fit of each collective to `bench comm` JSON, the
after-compute cost of a step's first collective (Wake), and the Network a prediction runs on.

The model (forms, their message steps L(W) and bytes B(W, S), the relative-error least squares)
is in shmlearn/analysis/simulate/main.py's docstring.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from shmlearn.errors import BadInput

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


# --- which measurement: the path a run's collectives take -------------------------------------

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                       "results")
"""The repository's results/: the committed `bench comm` files of the CPU."""
CPU_COMM = {"shared-memory": ("comm-shm-cpu.json", "comm-shm-cpu-after-compute.json"),
            "gloo": ("comm-gloo-cpu.json", "comm-gloo-cpu-after-compute.json")}
"""The committed CPU measurements by path (back to back, after compute): `bench comm` on the
2-core machine with --shared-memory auto and off (docs/scaling.md)."""


def collectives_of(doc: Dict[str, Any]) -> str:
    """The path a `bench comm` JSON measured: shared-memory, gloo or nccl (env.collectives; a
    file from before the field is its backend's)."""
    env = doc.get("env") or {}
    return env.get("collectives") or env.get("backend") or "gloo"


def cpu_path(shared_memory: Optional[str]) -> str:
    """The path a CPU run of one host takes under train's --shared-memory (None: its default, auto)."""
    return "gloo" if shared_memory == "off" else "shared-memory"


def default_comm(device: str, shared_memory: Optional[str] = None) -> Tuple[Optional[str], Optional[str]]:
    """(the committed comm JSON, its after-compute JSON or None) of the path a CPU run of one host
    takes (`cpu_path`); (None, None) on other devices or when the file is not there."""
    if not str(device).startswith("cpu"):
        return None, None
    c, a = (os.path.join(RESULTS, f) for f in CPU_COMM[cpu_path(shared_memory)])
    if not os.path.exists(c):
        return None, None
    return c, a if os.path.exists(a) else None


def check_path(doc: Dict[str, Any], source: str, flag: str, want: Optional[str]) -> None:
    """BadInput unless the JSON measured the path `want` (None: any)."""
    got = collectives_of(doc)
    if want is not None and got != want:
        raise BadInput(f"{flag} {source}: measured {got} collectives, not the {want} ones asked for")


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
        return cls(name=f"{collectives_of(doc)} on {e['device']}", all_reduce=fits["all_reduce"]["ring"],
                   gather=fits["gather"]["flat"], broadcast=fits["broadcast"]["flat"], source=source)

    @classmethod
    def assumed(cls, bw_GBps: float, latency_us: float, name: str) -> "Network":
        a, bw = latency_us * 1e-6, bw_GBps * 1e9
        mk = lambda op, form: Fit(op, form, a, bw, float("nan"), float("nan"), 0)  # noqa: E731
        return cls(name=name, all_reduce=mk("all_reduce", "ring"), gather=mk("gather", "flat"),
                   broadcast=mk("broadcast", "flat"), source=f"assumed: {bw_GBps} GB/s per link, "
                                                            f"{latency_us} us per message step")
