"""What one rank's step ran, as the run directory records it (Stepper.summary(), written into
summary.json by record/runs.py). Each field is a summary.json key of the same name."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class StepSummary:
    """How a rank's step ran: its mode, compiler and kernels (DESIGN.md's output contract)."""

    step_mode: str
    """classic | fast-eager | cuda-graph | free-running (fast.py's module docstring)."""
    check_every: int
    """Steps between two reads of the loss (1 for the classic step)."""
    step_note: Optional[str]
    """Why the step is not what was asked for, in one line (or None)."""
    compile: str
    """The torch.compile mode that the step runs, or off."""
    compile_s: Optional[float]
    """Seconds spent compiling, or None where nothing was compiled."""
    compile_read: bool
    """Whether the read of the losses was compiled too (step/compile.py)."""
    image_conv: str
    """--image-conv's kernel as resolved for this device."""
    image_convs: int
    """How many convolutions run it."""
    max_pool: str
    """--max-pool's kernel as resolved."""
    max_pools: int
    """How many max-pools run it."""
    conv_pool: str
    """--conv-pool's kernel as resolved."""
    conv_pools: int
    """How many conv + ReLU + max-pool blocks run fused."""
    mlp_head: str
    """--mlp-head's kernel as resolved."""
    mlp_heads: int
    """How many classifier heads run fused."""
    kernels: List[Dict[str, Any]]
    """Each layer's kernel and why not where it runs torch's ops (nn/choice.py's as_dict)."""
    kernel_notes: List[str]
    """One line per kernel left to torch for this device's sake."""
    conv_overlap: str
    """--conv-overlap as resolved."""
    conv_overlaps: int
    """How many convolutions run their backward GEMMs on two streams."""
    conv_overlap_deferred: bool
    """Whether their weight GEMMs run on until the backward ends."""
    combo_kernels: bool
    """Whether the compiled step runs Inductor's combo kernels (--combo-kernels, step/compile.py)."""
    update_kernel: str
    """What applies the update: flat, torch-fused, torch-foreach (behind step/gate.py) or optimizer
    (step/kernels.py)."""
    update_in_backward: bool
    """Whether convolutions take their SGD step inside the backward."""
    weight_copy: bool
    """Whether the update writes the convolutions' bf16 weights for the next forward."""
    grad_buckets: int
    """How many buckets the gradient average runs in during the backward (0: after it)."""
    graph_memsets_replaced: int
    """Memsets replaced in the captured CUDA graphs (step/graph_memsets.py)."""
    phase_sample_every: Optional[int]
    """With CUDA graphs: one step in this many runs eagerly with its phases timed; else None."""
    collectives: Optional[str] = None
    """How the strategy's collectives run (allreduce's and weight-avg's average, ps's gather and
    broadcast, async-ps's messages, and the fast step's read of the losses with them):
    shared-memory (a CPU run's ranks on one host, sync/shm.py, sync/shm_mailbox.py), or the
    process group's backend (gloo, nccl; async-ps's messages: gloo); None at one worker and for
    ddp (Gloo or NCCL, always)."""
    collectives_note: Optional[str] = None
    """Why a CPU run's collectives (or async-ps's messages) run on Gloo, not shared memory, under
    --shared-memory auto."""

    def fields(self) -> Dict[str, Any]:
        """summary.json's entries, in this order."""
        return asdict(self)
