"""simulate's predictor: a step's time by part for each strategy at W workers on a Machine (a
Compute and a Network), the scaling table, and the check against measured runs.

Each strategy's own parts come from its registry entry's cost model (shmlearn/sync/); the
formulas are in shmlearn/analysis/simulate/main.py's docstring.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from shmlearn.record import readback
from shmlearn.errors import BadInput
from shmlearn.step.fast import DEFAULT_CHECK_EVERY
from shmlearn.analysis.simulate.comm import Network, Wake
from shmlearn.analysis.simulate.compute import Compute, _bench_row, _bench_strategies, _read_json, _variant_strategy
from shmlearn.sync import registry
from shmlearn.sync.registry import Costs

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
        if run_dir:
            values = readback.run_config(run_dir, missing_ok=True)
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
            runs = readback.need(d, {"runs": list}, f"--measured {p}")["runs"] if "runs" in d else [d]
        for i, s in enumerate(runs):
            if not isinstance(s, dict) or s.get("status", "completed") != "completed" or not s.get("steps"):
                readback.need(s, {}, f"--measured {p} run {i + 1}")  # an object, or one line
                continue
            if "step_s" not in s:  # a run's summary: what the prediction reads from it
                readback.need(s, {"workers": int, "batch_size": int, "steps": int, "wall_time_s": readback.NUMBER},
                              f"--measured {p}" + (f" run {i + 1}" if "runs" in d else ""))
            # The loop the run used: a run records it since the fast step exists (older runs were
            # classic: 1); a bench throughput row records only its mode (None: the Machine's).
            ce = s.get("check_every", (s.get("summary") or {}).get("check_every"))
            if ce is None and ("summary" in s or "wall_time_s" in s):
                ce = 1
            name, params = _strategy_of(s, p if os.path.isdir(p) else None)
            out.append({"name": s.get("name", p), "strategy": name, "workers": s["workers"],
                        "check_every": int(ce) if ce else None,
                        "batch_size": s["batch_size"] * s.get("accumulate", 1), "model": s.get("model"),
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
