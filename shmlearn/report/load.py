"""Read what reports draw: a run directory (runs.py's contract) or a sweep directory (sweep.py's).

Tolerant of what a kill leaves: a run killed before summary.json still has its curves, and is
shown as 'incomplete' rather than refused (a torn last line of a JSON-lines file is dropped).
Strict about anything else: a malformed file is one line naming it (shmlearn/record/readback.py). A sweep's winners are drawn from their trial folders where
present, else from the curves winners.json keeps (results.add_curves), so the folders may go."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from shmlearn.record import readback
from shmlearn.errors import BadInput
from shmlearn.sweeps.results import ResultStore, pick_winners

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
    curves: Dict[str, Any] = field(default_factory=dict)
    """winners.json's 'curves' by trial id; empty for a winners.json written before them."""

    def run(self, row: Dict[str, Any]) -> Optional[Run]:
        """The trial as a Run: from its folder, else (the folder removed) from its row and kept curves."""
        path = os.path.join(self.path, row.get("run_dir") or "")
        if os.path.isdir(path) and is_run(path):
            return load_run(path, label=row_label(row))
        c = self.curves.get(row["id"]) or {}
        if "loss" not in c:
            return None
        return Run(path, row["config"], row["summary"],
                   [{"step": s, "time_s": t, "loss": v} for s, t, v in c["loss"]],
                   [{"time_s": t, "test_accuracy": a, "test_loss": v} for t, a, v in c.get("eval", [])],
                   label=row_label(row))


def is_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metrics.jsonl")) or os.path.isfile(os.path.join(path, "summary.json"))


def is_sweep(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "results.jsonl")) or os.path.isfile(os.path.join(path, "sweep.json"))


def load_run(path: str, *, label: str = "") -> Run:
    """A run as its files hold it (readback: anything malformed is one line naming the file); a
    run killed before summary.json or config.yaml has its curves, and status 'incomplete'."""
    if not os.path.isdir(path) or not is_run(path):
        raise BadInput(f"{path}: not a run directory (no metrics.jsonl or summary.json)")
    run = Run(path, readback.run_config(path, missing_ok=True), readback.run_summary(path, missing_ok=True),
              readback.run_metrics(path, missing_ok=True), readback.run_evals(path))
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
    spec = readback.sweep_spec(path)
    store = ResultStore(os.path.join(path, "results.jsonl"))
    rows = store.load(repair=False)
    order = spec.get("trials")
    if order:  # the last command's grid, in its order
        by_id = {r["id"]: r for r in rows}
        rows = [by_id[i] for i in order if i in by_id]
    swept = spec.get("axis_order") or []
    winners = pick_winners(rows, threshold=spec.get("threshold", 1.8),
                           target_accuracy=spec.get("target_accuracy"), swept=swept,
                           metric=spec.get("winner_metric"), goal=spec.get("winner_goal"),
                           time_axis=spec.get("time_axis", "wall"), target_share=spec.get("target_share"))
    # No winners.json yet (a sweep still running): the trial folders are there.
    wpath = os.path.join(path, "winners.json")
    kept = readback.read_json(wpath) if os.path.lexists(wpath) else {}
    curves: Dict[str, Any] = readback.need(kept, {}, wpath, optional={"curves": (dict, None)}).get("curves") or {}
    return SweepData(path, spec, rows, winners, store.notes, curves)
