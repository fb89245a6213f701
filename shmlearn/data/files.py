"""Where each file dataset's files are, and whether they are there: the cheap half of loading,
without numpy or torch.

The CLI runs `check_present` before it imports torch (cli.precheck), so a missing --data-dir is
refused in a fraction of a second; `train()` runs it again before any worker starts, and the
readers (idx.py, cifar.py, tiny_imagenet.py) find their files with the same functions, so the
three say the same line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import BadInput

FILE_DATASETS = ("fashion-mnist", "mnist", "cifar10", "tiny-imagenet")
"""The built-in datasets read from files (the others ignore --data-dir)."""

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# Debian's dataset-fashion-mnist package puts the four gzipped files here.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def require_dir(data_dir: str | Path) -> Path:
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise BadInput(f"--data-dir {data_dir}: no such directory")
    return path


def mnist_folder(name: str, data_dir: Optional[str]) -> Path:
    """The folder holding `name`'s IDX files; BadInput with one line if there is none."""
    if data_dir is not None:
        folder = require_dir(data_dir)
    elif name == "fashion-mnist":
        folder = FASHION_MNIST_DIR
        if not folder.is_dir():
            raise BadInput(f"fashion-mnist: no --data-dir given and {folder} does not exist;"
                           f" install Debian's dataset-fashion-mnist or pass --data-dir with"
                           f" the four IDX files")
    else:
        raise BadInput(f"--data-dir: {name} needs a --data-dir holding the four IDX files"
                       f" {', '.join(IDX_FILES)} (each optionally gzipped)")
    return folder


def find_idx(name: str, folder: Path, stem: str) -> Path:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise BadInput(f"{name}: no {stem}[.gz] in {folder} (expected the four IDX files"
                   f" {', '.join(IDX_FILES)}, each optionally gzipped)")


def cifar_dir(data_dir: Optional[str]) -> Path:
    if data_dir is None:
        raise BadInput("--data-dir: cifar10 needs a --data-dir holding cifar-10-batches-py/"
                       " or cifar-10-batches-bin/ (or the batch files themselves)")
    return require_dir(data_dir)


def find_batches(root: Path) -> tuple[Path, str]:
    """The folder holding the CIFAR-10 batches and the suffix of their files ("" python, ".bin"
    binary)."""
    for folder in (root, root / "cifar-10-batches-py", root / "cifar-10-batches-bin"):
        for suffix in ("", ".bin"):
            if (folder / f"data_batch_1{suffix}").is_file():
                return folder, suffix
    raise BadInput(f"cifar10: no data_batch_1 or data_batch_1.bin in {root} or in its"
                   f" cifar-10-batches-py/ or cifar-10-batches-bin/ subfolders")


def tiny_imagenet_dir(data_dir: Optional[str]) -> Path:
    if data_dir is None:
        raise BadInput("--data-dir: tiny-imagenet needs a --data-dir holding tiny-imagenet-200/")
    return require_dir(data_dir)


def find_tiny_root(data_dir: Path) -> Path:
    for root in (data_dir, data_dir / "tiny-imagenet-200"):
        if (root / "wnids.txt").is_file():
            return root
    raise BadInput(f"tiny-imagenet: no wnids.txt in {data_dir} or {data_dir / 'tiny-imagenet-200'}"
                   f" (expected the tiny-imagenet-200 folder: wnids.txt, train/, val/)")


def check_present(name: str, data_dir: Optional[str]) -> None:
    """The cheap half of `load_dataset`'s checks, for before any worker starts: the folder and
    the files it needs are there (reading them is each worker's). BadInput with the same line
    load_dataset would give; nothing for a dataset that reads no files."""
    if name in ("fashion-mnist", "mnist"):
        folder = mnist_folder(name, data_dir)
        for stem in IDX_FILES:
            find_idx(name, folder, stem)
    elif name == "cifar10":
        find_batches(cifar_dir(data_dir))
    elif name == "tiny-imagenet":
        find_tiny_root(tiny_imagenet_dir(data_dir))
