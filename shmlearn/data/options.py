"""The data's section of the run's config (DataOptions): which dataset, where its files are, the
task of the user's own data, how it is read and augmented. TrainConfig is composed of it
(config/train_config.py); the loaders read it (data/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from shmlearn.config.flags import Section
from shmlearn.data.user import LOADERS, TASKS


@dataclass(kw_only=True)
class DataOptions(Section):
    """The training and test data, and how batches are read."""

    dataset: str = "digits"
    """A built-in dataset by name (shmlearn.data.DATASETS), or your own:
    FILE.py:NAME or pkg.module:NAME, NAME a callable returning (train_x, train_y, test_x, test_y)
    arrays or a pair of torch Datasets."""
    data_dir: Optional[str] = None
    """Folder holding the dataset's files (IDX, CIFAR batches, tiny-imagenet-200)."""
    task: Optional[Literal[TASKS]] = None
    """Your own data only (data= or --dataset FILE.py:NAME): classification, binary or regression.
    Default: from the labels (integers: classification, floats: regression)."""
    loader: Literal[LOADERS] = "auto"
    """Your own torch Datasets only: resident (read whole onto the device before the first step),
    stream ((x, y) Datasets: a DataLoader with worker processes reads each batch; with
    compute_loss: the train split stays in host memory and each batch is copied to the device),
    or auto (resident when it takes at most half the device's free memory). With compute_loss,
    stream, and auto on the CPU, read a split of 4096 items or more as training first needs its
    rows: each worker reads its own batches before each step, and its slice of the test split."""
    augment: str = "none"
    """Training-image augmentation on the device, chosen by (seed, epoch, position): none, flip,
    translate:N (shift by up to N pixels, zero fill) or both, e.g. 'flip,translate:2'."""
