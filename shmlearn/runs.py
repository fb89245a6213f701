"""The run directory: the output contract that tests, sweeps and reports read
(docs/architecture.md, "The output contract").

    config.yaml    the resolved TrainConfig
    metrics.jsonl  one line per logged step: step, samples, time_s, loss, phase_s
    eval.jsonl     one line per evaluation: step, time_s, samples, test_loss, test_accuracy
    summary.json   the run's result (see `summarize`)
    trace.json     Chrome trace of every rank's phases (opens in Perfetto)
    tensorboard/   with --tensorboard: the same curves as TensorBoard event files (tblog.py)

Only rank 0 writes. JSONL lines are flushed as they are written, so a killed run keeps its curve.
summary.json is written last, atomically (temp file + rename): a reader never sees half of one.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

from shmlearn.config import TrainConfig, save_yaml
from shmlearn.errors import BadInput
from shmlearn.tblog import TensorBoardLog

RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "summary.json", "trace.json")


def default_run_dir(cfg: TrainConfig, workers: int, claim: bool = False) -> str:
    """runs/STAMP-MODEL-DATASET-STRATEGY-wN. claim: create it now, taking the first of NAME,
    NAME-2, NAME-3, ... that no one has (two runs started in the same second each get their
    own); without claim (the ranks of a launcher's job, which must agree) the plain name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join("runs", f"{stamp}-{_dir_word(cfg.model)}-{_dir_word(cfg.dataset)}-{cfg.strategy}-w{workers}")
    if not claim:
        return base
    k = 1
    while True:
        path = base if k == 1 else f"{base}-{k}"
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            k += 1
        except OSError as e:
            raise BadInput(f"--out {path}: cannot write there ({e.strerror})") from None


def _dir_word(name: str) -> str:
    """A model or dataset as part of one folder name: your own (`dir/own.py:Net`, `pkg.mod:load`,
    `python:ndarray arrays`) by its NAME, since the path's slashes would nest folders; other
    characters than letters, digits, '.', '_' and '-' become '-'. Built-in names stay as they are."""
    word = re.sub(r"[^A-Za-z0-9._-]+", "-", name.rpartition(":")[2]).strip("-.")
    return word or "own"


def check_out_dir(path: str) -> None:
    """Refuse to write over an earlier run: nothing already written is lost."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"--out {path}: exists and is not a directory")
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in RUN_FILES):
        raise BadInput(f"--out {path}: already holds a run; choose another directory")


def lock_dir(path: str, busy: str, *, shared: bool = False):
    """Take PATH/.lock with flock, exclusive (or shared), without waiting: the open file holds
    the lock (closing it lets go; it dies with the process, kill -9 included). Held by another
    process: BadInput(busy). PATH cannot be written: BadInput naming it. A run's --out, a
    sweep's and a study's all lock through here."""
    import fcntl
    try:
        f = open(os.path.join(path, ".lock"), "a+")
    except OSError as e:
        raise BadInput(f"--out {path}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise BadInput(busy) from None
    return f


@contextmanager
def lock_out_dir(path: str) -> Iterator[None]:
    """Hold --out for one run: create it (exit 2, one line, if it cannot be) and take an
    exclusive lock on PATH/.lock, so a second run on the same --out is refused instead of
    interleaving its lines with ours."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--out {path}: cannot write there ({e.strerror})") from None
    f = lock_dir(path, f"--out {path}: another run is writing there; choose another directory")
    try:
        yield
    finally:
        f.close()


def finite_json(obj: Any) -> Any:
    """obj with every NaN or infinite float as None: JSON has no NaN (Python's bare `NaN` token
    is invalid JSON to every other reader), and these files say 'no value' with null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk: named (a write error carries no path), no temp file left
        if os.path.exists(tmp):
            os.remove(tmp)
        if e.filename is None:
            raise OSError(e.errno, e.strerror, path) from None
        raise


class RunDir:
    def __init__(self, path: str, cfg: TrainConfig, *, keep_until: Optional[int] = None):
        """keep_until: resuming from this step; rows logged after it will be logged again, so
        they are dropped (a crash between log and checkpoint must not leave duplicates)."""
        self.path = path
        os.makedirs(path, exist_ok=True)
        save_yaml(cfg, os.path.join(path, "config.yaml"))
        if keep_until is not None:
            for name in ("metrics.jsonl", "eval.jsonl"):
                _truncate_after(os.path.join(path, name), keep_until)
            summary = os.path.join(path, "summary.json")
            if os.path.exists(summary):
                os.remove(summary)  # describes the interrupted attempt, not this one
        mode = "a" if keep_until is not None else "w"
        self._metrics = open(os.path.join(path, "metrics.jsonl"), mode, buffering=1)
        self._eval = open(os.path.join(path, "eval.jsonl"), mode, buffering=1)
        self.tensorboard = TensorBoardLog(path, resumed_after=keep_until) if cfg.tensorboard else None

    def log_metrics(self, row: Dict[str, Any], lr: Any = None) -> None:
        """lr: for TensorBoard only (metrics.jsonl has no lr column)."""
        with _naming(self._metrics.name):
            self._metrics.write(json.dumps(row) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.metrics(row, lr)

    def log_eval(self, row: Dict[str, Any]) -> None:
        with _naming(self._eval.name):
            self._eval.write(json.dumps(finite_json(row), allow_nan=False) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.eval(row)

    def write_trace(self, trace: dict) -> None:
        path = os.path.join(self.path, "trace.json")
        with _naming(path):
            tmp = f"{path}.tmp.{os.getpid()}"
            try:
                with open(tmp, "w") as f:
                    json.dump(trace, f)
                os.replace(tmp, path)  # whole or absent, never torn
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)

    def write_summary(self, summary: Dict[str, Any]) -> None:
        path = os.path.join(self.path, "summary.json")
        with _naming(path):
            write_json_atomic(path, finite_json(summary))

    def close(self) -> None:
        self._metrics.close()
        self._eval.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def loss_area(times: List[float], losses: List[float]) -> Optional[float]:
    """Trapezoid area under the training loss over training seconds (the paper's selection
    metric, seed 000): small when the loss falls low and falls fast."""
    if len(times) < 2:
        return None
    return sum((t1 - t0) * (l0 + l1) / 2 for t0, t1, l0, l1 in zip(times, times[1:], losses, losses[1:]))


@contextmanager
def _naming(path: str) -> Iterator[None]:
    """An OSError while writing (a full disk) names the file: a write error carries no path."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, f"{e.strerror} (writing {path})") from e
        raise


def _truncate_after(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError):
                break  # a torn last line from a kill
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
