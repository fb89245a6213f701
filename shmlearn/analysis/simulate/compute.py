"""simulate's compute: one worker's step by part (Compute), read from a one-worker run's
summary.json, a throughput JSON or a `bench throughput` JSON, and the model's parameter count.

What the parts are and how P processes sharing cores slow them: shmlearn/analysis/simulate/main.py's docstring.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from shmlearn.record import readback
from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput
from shmlearn.models import build_model
from shmlearn.sync import registry

DATASET_SHAPES = {  # (C, H, W), classes: what model sizes depend on (no files are read)
    "synthetic": ((3, 32, 32), 10), "cifar10": ((3, 32, 32), 10), "mnist": ((1, 28, 28), 10),
    "fashion-mnist": ((1, 28, 28), 10), "tiny-imagenet": ((3, 64, 64), 200), "digits": ((1, 8, 8), 10),
}


def parameter_count(model: str, dataset: str = "synthetic", input_shape=None, classes=None) -> int:
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
    """A flag's JSON object (or a run directory's summary.json), or BadInput naming the flag and
    the file (readback.read_json)."""
    f = os.path.join(path, "summary.json") if os.path.isdir(path) else path
    return readback.read_json(f, dict, what=flag)


def load_compute(path: str, batch: Optional[int] = None) -> Compute:
    """A run directory or its summary.json (one worker), a throughput JSON, or a `bench
    throughput` JSON (its one-worker row at `batch`)."""
    d = _read_json("--compute", path)
    if os.path.isdir(path):  # a run directory: a damaged one is refused whole, not read around
        readback.run_config(path, missing_ok=True)
    if d.get("benchmark") == "throughput" and "results" in d:
        d = throughput_compute(d, batch, path)
    model = d.get("model")
    batch = d.get("batch_size") or d.get("batch")
    if batch and d.get("accumulate", 1) > 1:  # a run's step computed N micro-batches (--accumulate)
        batch *= d["accumulate"]
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
