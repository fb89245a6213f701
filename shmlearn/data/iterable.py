"""A train split given as an IterableDataset without __len__ (an endless stream, or one of unknown
length), under the general contract: never read whole (data/host.py's StreamTreeLoader reads it a
global batch a step). Here: the stream itself, its first items (what the checks before training
read) and the budget it needs."""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import IterableDataset, default_collate

from shmlearn.errors import BadInput


def is_stream(ds) -> bool:
    """An IterableDataset with no __len__: its epochs cannot be counted (one with a length is read
    whole, data/tree.py)."""
    return isinstance(ds, IterableDataset) and not hasattr(ds, "__len__")


def given_stream(obj) -> bool:
    """Whether the data= given (before anything is called) has a train split that `is_stream`:
    a bare IterableDataset or a DataLoader over one, first of a tuple of splits."""
    if not isinstance(obj, (tuple, list)) or len(obj) not in (2, 3):
        return False
    train = obj[0].dataset if isinstance(obj[0], torch.utils.data.DataLoader) else obj[0]
    return is_stream(train)


class TrainStream:
    """A train IterableDataset without __len__ (and a DataLoader's collate_fn, or None for torch's
    default_collate). head: its first two items collated, what the checks before training read
    (the structure every batch must have, the model check's two samples)."""

    def __init__(self, ds, collate, what: str):
        self.ds, self.collate, self.what = ds, collate, what
        items = []
        for item in self.items():
            items.append(item)
            if len(items) == 2:
                break
        if len(items) < 2:
            raise BadInput(f"{what}: the train IterableDataset gave {len(items)} item{'s' * (len(items) != 1)}; "
                           f"a stream to train on needs at least two")
        self.head = self.collated(items, 0)
        self.structure = tree_flatten(self.head)[1]

    def items(self):
        """A fresh pass over the stream; what the user's iterator raises is one line (BadInput)."""
        it = iter(self.ds)
        n = 0
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except BadInput:
                raise
            except Exception as e:  # noqa: BLE001 - the user's iterator
                raise BadInput(f"{self.what}: the train IterableDataset raised {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:200] if str(e) else ''} after {n} items") from None
            n += 1
            yield item

    def collated(self, items: list, first: int):
        """The items collated (its collate_fn or default_collate) into a tree of tensors; BadInput
        naming the stream's items first.. otherwise."""
        try:
            tree = (self.collate or default_collate)(items)
        except Exception as e:  # noqa: BLE001 - default_collate's refusal, or the user's collate_fn
            raise BadInput(f"{self.what}: the train stream's items {first}..{first + len(items) - 1} cannot be batched "
                           f"({str(e).splitlines()[0][:200]}); every item needs the same structure, tensors of one "
                           f"shape") from None
        leaves, spec = tree_flatten(tree)
        if hasattr(self, "structure") and spec != self.structure:
            raise BadInput(f"{self.what}: the train stream's items {first}..{first + len(items) - 1} have another "
                           f"structure than its first items")
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise BadInput(f"{self.what}: the train stream's items hold a {type(leaf).__name__}; only tensors, "
                               f"numbers and numpy arrays can be batched on the device")
        return tree


def check_budget(samples: Optional[int], what: str) -> None:
    """A train stream's run needs --samples: its epochs cannot be counted."""
    if samples is None:
        raise BadInput(f"{what}: the train split is an IterableDataset without __len__ (endless, or of unknown "
                       f"length), whose epochs cannot be counted; give the budget in samples "
                       f"(--samples N, TrainConfig(samples=N))")


