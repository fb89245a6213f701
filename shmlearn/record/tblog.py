"""TensorBoard event files of a run (--tensorboard, issue 41): rank 0 writes RUN/tensorboard/
beside metrics.jsonl and eval.jsonl, from the same rows (RunDir passes them on), so TensorBoard
shows what the run directory records.

    train/loss            metrics.jsonl's loss (mean over workers), every --log-every steps
    train/lr              the first parameter group's learning rate as the line is written
                          (the one the next step uses)
    train/samples_per_s   samples over training seconds since the previous line
    phase_s/<phase>       metrics.jsonl's phase_s: seconds per step in each timed phase
    test/loss, test/accuracy   eval.jsonl's (accuracy only for classification)

The x axis is the step. A sweep's trials are run directories under SWEEP/trials/, so
`tensorboard --logdir SWEEP` shows each trial as a run of one log dir.

torch.utils.tensorboard needs the tensorboard package, an extra: `require` refuses --tensorboard
without it in one line (config.validate, before any worker starts). This module imports neither
torch nor tensorboard until a writer is made.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from shmlearn.record import safe_write
from shmlearn.errors import BadInput

TB_DIR = "tensorboard"
"""The event files' folder inside the run directory."""


def require() -> None:
    """BadInput unless the tensorboard package can be imported."""
    try:
        import tensorboard  # noqa: F401 - an optional dependency, probed only when --tensorboard is on
    except ImportError:
        raise BadInput("--tensorboard: the tensorboard package is not installed; "
                       "pip install 'shmlearn[tensorboard]'") from None


class TensorBoardLog:
    """A SummaryWriter over RUN/tensorboard fed metrics and eval rows."""

    def __init__(self, run_dir: str, *, resumed_after: Optional[int] = None):
        """resumed_after: the step a resumed run continues from. TensorBoard drops what an earlier
        attempt in this folder logged after it (SummaryWriter's purge_step), as RunDir drops its
        rows; a run that starts at step 0 (a --resume with no checkpoint) drops all of it."""
        # torch.utils.tensorboard imports the optional tensorboard package: only when asked for.
        from torch.utils.tensorboard import SummaryWriter
        safe_write.makedirs(os.path.join(run_dir, TB_DIR), root=run_dir)  # never a link out of the run
        self.writer = SummaryWriter(os.path.join(run_dir, TB_DIR), flush_secs=10,
                                    purge_step=0 if resumed_after is None else resumed_after + 1)
        # (samples, training seconds) at the previous line; unknown for a resumed run's first
        self._prev = None if resumed_after is not None else (0, 0.0)

    def metrics(self, row: Dict[str, Any], lr: Any = None) -> None:
        step, add = row["step"], self.writer.add_scalar
        add("train/loss", float(row["loss"]), step)
        if lr is not None:
            add("train/lr", float(lr), step)  # float(): a tensor where the fast step captured it
        samples, t = row["samples"], row["time_s"]
        if self._prev is not None and t > self._prev[1]:
            add("train/samples_per_s", (samples - self._prev[0]) / (t - self._prev[1]), step)
        self._prev = (samples, t)
        for phase, seconds in (row.get("phase_s") or {}).items():
            add(f"phase_s/{phase}", float(seconds), step)

    def eval(self, row: Dict[str, Any]) -> None:
        self.writer.add_scalar("test/loss", float(row["test_loss"]), row["step"])
        if row.get("test_accuracy") is not None:
            self.writer.add_scalar("test/accuracy", float(row["test_accuracy"]), row["step"])

    def close(self) -> None:
        self.writer.close()
