"""What a run gives back (RunResult, train()'s return), and what the ranks hand rank 0 at the end of
a run: their trace events and how their step ran (one gather, then rank 0 writes summary.json)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from shmlearn.step.summary import StepSummary


@dataclass
class RunResult:
    status: str
    """completed | diverged | failed"""
    run_dir: Optional[str]
    summary: Dict[str, Any]
    model: Optional[torch.nn.Module] = None
    """The trained model: rank 0's, on the CPU for local runs (the averaged one for weight-avg:
    replicas are equal after the last step); this rank's under torchrun/mpirun/srun."""
    rank: int = 0
    """The rank this result is from: 0 for local runs; under a launcher every rank gets one, so a
    script prints or saves where rank == 0."""


def gather_ranks(events: list, step: StepSummary, *, computes: bool, rank: int,
                 world_size: int) -> Tuple[Optional[List[list]], StepSummary]:
    """Every rank's trace events and the step summary to record, on rank 0 (one gather_object:
    a collective, so every rank calls it). Returns (each rank's events, a computing rank's step)
    on rank 0 and (None, this rank's step) on the others. A computing rank's step, because a
    dedicated parameter server (rank 0) runs no model step, compiles nothing and reads no batches."""
    mine = (events, step if computes else None)
    if world_size > 1:
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if not gathered:
        return None, step
    return [e for e, _ in gathered], next((s for _, s in gathered if s is not None), step)
