"""What every experiment shares: running configs through the one training loop, tables in
Markdown and CSV, curves read back from run directories, and figures."""
from __future__ import annotations

import csv
import json
import os
import shutil
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

from shmlearn.record import safe_write
from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import Diverged
from shmlearn.record.runs import read_jsonl, write_json_atomic
from shmlearn.train.entry import RunResult, train


@dataclass(frozen=True)
class Context:
    out: str
    """The experiment's folder: tables, figures and one run directory per config under runs/."""
    quick: bool = False
    """Shrink to a few minutes on 2 CPU cores, same code path."""
    device: str = "auto"
    axes: Dict[str, list] = field(default_factory=dict)
    """Sweeping experiments: axes that replace the experiment's own (`--axis lr=...`)."""


def run(ctx: Context, name: str, cfg: TrainConfig, *,
        extras: Optional[Callable[[Any], Dict]] = None) -> Dict:
    """Train one config into ctx.out/runs/name; a diverged run is a result, not an error.
    Returns the summary, with '_run_dir' and, when `extras` is given, '_extras': what
    extras(model) returned for the trained model (None if the run diverged), e.g. the fitted W
    and b.

    A run that already finished in that folder with the same config is read back, not trained
    again (its extras from runs/name/extras.json), so a long experiment that was stopped resumes
    where it was: the single-neuron study at 16 workers takes most of an hour on 2 cores."""
    out = os.path.join(ctx.out, "runs", name)
    cfg = replace(cfg, out=out, device=ctx.device, progress=False)
    done = finished(out, cfg)
    if done is not None and (extras is None or os.path.exists(os.path.join(out, "extras.json"))):
        print(f"{name}: finished earlier with the same config, read from {out}", flush=True)
        if extras is not None:
            with open(os.path.join(out, "extras.json")) as f:
                done["_extras"] = json.load(f)
        return done
    if os.path.isdir(out) and not os.path.exists(os.path.join(out, "summary.json")):
        # Stopped before it ended (no result): it runs again from the start.
        print(f"{name}: an unfinished earlier attempt is in {out}; running it again", flush=True)
        shutil.rmtree(out)
    try:
        result: RunResult = train(cfg)
        summary, model = dict(result.summary), result.model
    except Diverged:
        with open(os.path.join(out, "summary.json")) as f:
            summary, model = json.load(f), None
    summary["_run_dir"] = out
    if extras is not None:
        summary["_extras"] = extras(model) if model is not None else None
        write_json_atomic(os.path.join(out, "extras.json"), summary["_extras"])
    return summary


def finished(out: str, cfg: TrainConfig) -> Optional[Dict]:
    """The summary of a run in `out` that completed or diverged with exactly `cfg`, else None."""
    import yaml

    from shmlearn.record import yaml_io  # lazy: PyYAML, as the `import yaml` above

    try:
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(out, "config.yaml")) as f:
            saved = yaml_io.load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    try:  # a config saved before a field was added has no key for it: the field's default;
        # and the folder may have been moved since (its saved `out` is where it was written)
        same = ({**TrainConfig(**saved).to_dict(), "out": None} == {**cfg.to_dict(), "out": None})
    except TypeError:  # a field that no longer exists
        same = False
    if summary.get("status") not in ("completed", "diverged") or not same:
        return None
    summary["_run_dir"] = out
    return summary


def curve(run_dir: str, key: str = "loss", source: str = "metrics") -> tuple:
    """(steps, time_s, values) of a run's metrics.jsonl (loss) or eval.jsonl (test_*)."""
    rows = read_jsonl(os.path.join(run_dir, f"{source}.jsonl"))
    rows = [r for r in rows if r.get(key) is not None]
    return [r["step"] for r in rows], [r["time_s"] for r in rows], [r[key] for r in rows]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if (abs(v) < 1e-3 or abs(v) >= 1e5) and v != 0 else f"{v:.4f}"
    return "" if v is None else str(v)


def write_table(ctx: Context, name: str, rows: List[Dict], columns: Sequence[str],
                title: Optional[str] = None) -> str:
    """Write name.md and name.csv; return the Markdown (experiments print their main table)."""
    os.makedirs(ctx.out, exist_ok=True)
    with safe_write.atomic_file(os.path.join(ctx.out, f"{name}.csv"), "w") as f:  # whole or as it was
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = ([f"### {title}", ""] if title else []) + [
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    md = "\n".join(lines) + "\n"
    safe_write.write(os.path.join(ctx.out, f"{name}.md"), md)
    return md


def figure(ctx: Context, name: str):
    """A matplotlib figure and the path it will be saved to (Agg: no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    return fig, ax, os.path.join(ctx.out, f"{name}.png")


def save(fig, path: str) -> None:
    safe_write.finish_figure(fig, path)  # whole or as it was


def fashion_or(fallback: str, data_dir: Optional[str] = None) -> tuple:
    """(dataset, data_dir): MNIST when its files are given, Fashion-MNIST when installed, else
    the fallback (so a quick run works anywhere)."""
    if data_dir:
        return "mnist", data_dir
    if os.path.isdir("/usr/share/datasets/fashion-mnist"):
        return "fashion-mnist", None
    return fallback, None
