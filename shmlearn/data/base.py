"""What every dataset reader returns: tensors in memory plus the facts a model and a loss need."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Tuple

import torch

from ..errors import BadInput

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

    @property
    def n_train(self) -> int:
        return len(self.train_x)

    @property
    def n_test(self) -> int:
        return len(self.test_x)

    def to(self, device: torch.device) -> "Dataset":
        return Dataset(self.spec, self.train_x.to(device), self.train_y.to(device),
                       self.test_x.to(device), self.test_y.to(device), self.mean, self.std)


def dataset_len(ds, what: str, split: str) -> int:
    """len() of a user's map-style torch Dataset for `split` (train, test); BadInput naming `what`
    when it has none or is empty."""
    try:
        n = len(ds)
    except TypeError:
        raise BadInput(f"{what}: the {split} Dataset has no len(); a map-style Dataset "
                       f"(__len__ and __getitem__) is needed") from None
    if n == 0:
        raise BadInput(f"{what}: the {split} Dataset is empty")
    return n


def check_usable(ds: Dataset, where: str) -> None:
    """Refuse, with one line starting `where` (the flag or file the data came from), data that
    would crash evaluation or train on NaN: an empty split, or training inputs with nothing to
    normalize. Images are refused if any channel has std 0 (computed per channel over the whole
    train set, so the channel is one value everywhere); feature vectors only if every feature
    does, since a few constant features are normal (the normalizer leaves those unscaled)."""
    unit = "images" if ds.spec.is_image else "samples"
    for split, x in (("train", ds.train_x), ("test", ds.test_x)):
        if len(x) == 0:
            need = "nothing to learn" if split == "train" else "evaluation needs at least 1"
            raise BadInput(f"{where}: the {split} set has 0 {unit}; {need}")
    if ds.spec.is_image:
        if ds.std is None:
            return
        flat = [c for c, s in enumerate(ds.std) if s == 0]
        if not flat:
            return
        values = sorted({f"{ds.mean[c]:g}" for c in flat})
        if len(flat) == len(ds.std) and len(values) == 1:
            what = f"every training image has the same value {values[0]}"
        else:
            which = "channel" if len(flat) == 1 else "channels"
            verb = "holds" if len(flat) == 1 else "hold"
            what = (f"{which} {', '.join(map(str, flat))} of {len(ds.std)} {verb} one value"
                    f" ({', '.join(values)}) in every training image")
        raise BadInput(f"{where}: {what} (standard deviation 0); nothing to learn")
    std = (torch.tensor(ds.std) if ds.std is not None
           else ds.train_x.float().reshape(len(ds.train_x), -1).std(dim=0, unbiased=False))
    if not bool((std > 0).any()):
        raise BadInput(f"{where}: every training sample has the same {std.numel()} feature"
                       f" value(s) (standard deviation 0); nothing to learn")


def normalizer(ds: Dataset, device: torch.device):
    """Return f(x) -> float32 normalized batch. Built once so the hot path does no Python work
    beyond one subtract and one multiply."""
    if ds.mean is None:
        return lambda x: x.float()
    shape = (1, -1, 1, 1) if ds.spec.is_image else (1, -1)
    mean = torch.tensor(ds.mean, dtype=torch.float32, device=device).view(shape)
    std = torch.tensor(ds.std, dtype=torch.float32, device=device)
    # A constant feature (std 0) is only centred: dividing by 0 would turn every input NaN.
    # check_usable refuses data where that leaves nothing to learn.
    inv_std = torch.where(std > 0, 1.0 / std, torch.ones_like(std)).view(shape)
    return lambda x: (x.float() - mean) * inv_std
