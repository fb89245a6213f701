"""Read what reports draw: a run directory (runs.py's contract) or a sweep directory (sweep.py's).

Tolerant by design: a run killed before summary.json still has its curves, and is shown as
'incomplete' rather than refused."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import yaml

from shmlearn.errors import BadInput
from shmlearn.results import ResultStore, pick_winners

from .html import worker_count


@dataclass
class Run:
    path: str
    config: Dict[str, Any]
    summary: Dict[str, Any]
    metrics: List[Dict[str, Any]]
    evals: List[Dict[str, Any]]
    label: str = ""

    @property
    def status(self) -> str:
        return self.summary.get("status", "incomplete")


@dataclass
class SweepData:
    path: str
    spec: Dict[str, Any]
    rows: List[Dict[str, Any]]
    """results.jsonl rows of this sweep's grid, in grid order."""
    winners: Dict[str, Any]
    notes: List[str] = field(default_factory=list)

    def run(self, row: Dict[str, Any]) -> Optional[Run]:
        path = os.path.join(self.path, row.get("run_dir") or "")
        return load_run(path, label=row_label(row)) if os.path.isdir(path) else None


def _jsonl(path: str) -> List[Dict[str, Any]]:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut off by a kill ends the curve
    return rows


def is_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metrics.jsonl")) or os.path.isfile(os.path.join(path, "summary.json"))


def is_sweep(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "results.jsonl")) or os.path.isfile(os.path.join(path, "sweep.json"))


def load_run(path: str, *, label: str = "") -> Run:
    if not os.path.isdir(path) or not is_run(path):
        raise BadInput(f"{path}: not a run directory (no metrics.jsonl or summary.json)")
    summary, config = {}, {}
    try:
        with open(os.path.join(path, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError):
        pass
    try:
        with open(os.path.join(path, "config.yaml")) as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        pass
    run = Run(path, config, summary, _jsonl(os.path.join(path, "metrics.jsonl")),
              _jsonl(os.path.join(path, "eval.jsonl")))
    run.label = label or run_label(run)
    return run


def run_label(run: Run) -> str:
    g = {**run.config, **run.summary}
    return f"w{g.get('workers', '?')} b{g.get('batch_size', '?')} lr{g.get('lr', '?')} ({os.path.basename(os.path.normpath(run.path))})"


def row_label(row: Dict[str, Any]) -> str:
    c = row["config"]
    return f"{worker_count(c['workers'])}, batch {c['batch_size']}, lr {c['lr']:g}"


def load_sweep(path: str) -> SweepData:
    if not is_sweep(path):
        raise BadInput(f"{path}: not a sweep directory (no results.jsonl)")
    spec: Dict[str, Any] = {}
    if os.path.isfile(os.path.join(path, "sweep.json")):
        with open(os.path.join(path, "sweep.json")) as f:
            spec = json.load(f)
    store = ResultStore(os.path.join(path, "results.jsonl"))
    rows = store.load(repair=False)
    order = spec.get("trials")
    if order:  # the last command's grid, in its order
        by_id = {r["id"]: r for r in rows}
        rows = [by_id[i] for i in order if i in by_id]
    swept = spec.get("axis_order") or []
    winners = pick_winners(rows, threshold=spec.get("threshold", 1.8),
                           target_accuracy=spec.get("target_accuracy"), swept=swept)
    return SweepData(path, spec, rows, winners, store.notes)
