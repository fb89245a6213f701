"""Where a run's processes go and how they compute: the device, the backend between them, the
default number of workers, and deterministic numerics (train.py decides with these once per run)."""
from __future__ import annotations

import os

import torch

from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput


def default_workers(cuda: bool, gpus: int, servers: int) -> int:
    """--workers when not given, locally: 2, and on CUDA no more than the GPUs present hold (one
    process per GPU; a strategy's serving ranks, e.g. a dedicated parameter server, take theirs)."""
    if not cuda:
        return 2
    return max(1, min(2, gpus - int(servers)))


def backend_for(cfg: TrainConfig, cuda: bool) -> str:
    """--backend: auto is NCCL on GPUs, Gloo on the CPU."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if cuda else "gloo"


def device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return device


def set_determinism(on: bool, device: torch.device) -> None:
    """Set (or clear: a pool worker runs many configs) deterministic numerics for this run."""
    if on and device.type == "cuda":
        # cuBLAS reads this when it creates its handle (the process's first matrix product);
        # without it, deterministic mode makes matrix products raise.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Only on a change: torch's setter imports Inductor's config (about 1 s of every worker's
    # start-up on a CPU) even to clear a flag that is already clear.
    if torch.are_deterministic_algorithms_enabled() != on or (
            on and not torch.is_deterministic_algorithms_warn_only_enabled()):
        torch.use_deterministic_algorithms(on, warn_only=True)
    torch.backends.cudnn.deterministic = on
