"""What every dataset reader returns: tensors in memory plus the facts a model and a loss need."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Tuple

import torch

Task = Literal["classification", "binary", "regression"]


@dataclass(frozen=True)
class DataSpec:
    """Shape facts a model builder adapts to; it never sees the data itself."""

    name: str
    task: Task
    input_shape: Tuple[int, ...]
    """(C, H, W) for images, (F,) for feature vectors."""
    num_outputs: int
    """Number of classes for classification; 1 for binary (one logit) and regression (one value)."""

    @property
    def is_image(self) -> bool:
        return len(self.input_shape) == 3


@dataclass
class Dataset:
    """A whole dataset in memory. Images stay uint8 (4x less memory, and the device-resident
    loader converts a batch at a time); features and regression targets are float32."""

    spec: DataSpec
    train_x: torch.Tensor
    train_y: torch.Tensor
    """int64 class labels (classification), float32 (N, 1) targets (binary, regression)."""
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: Optional[Tuple[float, ...]] = None
    """Per-channel mean in the units of the stored values (0..255 for uint8); None: no normalization."""
    std: Optional[Tuple[float, ...]] = None

    def __post_init__(self) -> None:
        assert len(self.train_x) == len(self.train_y), "train x/y lengths differ"
        assert len(self.test_x) == len(self.test_y), "test x/y lengths differ"

    def to(self, device: torch.device) -> "Dataset":
        return Dataset(self.spec, self.train_x.to(device), self.train_y.to(device),
                       self.test_x.to(device), self.test_y.to(device), self.mean, self.std)


def normalizer(ds: Dataset, device: torch.device):
    """Return f(x) -> float32 normalized batch. Built once so the hot path does no Python work
    beyond one subtract and one multiply."""
    if ds.mean is None:
        return lambda x: x.float()
    shape = (1, -1, 1, 1) if ds.spec.is_image else (1, -1)
    mean = torch.tensor(ds.mean, dtype=torch.float32, device=device).view(shape)
    inv_std = (1.0 / torch.tensor(ds.std, dtype=torch.float32, device=device)).view(shape)
    return lambda x: (x.float() - mean) * inv_std
