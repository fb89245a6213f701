"""Device-resident augmentation by index: random translate (a crop of a zero-padded image) and
horizontal flip, chosen per sample by a hash of (seed, epoch, position in the epoch).

No random generator is consumed, so:
  * the augmented batch at a step is a pure function of (seed, step): a resumed run sees the
    same images, and W workers at batch B see exactly what one process at batch W*B sees;
  * everything runs on the device with fixed shapes and no host sync, so it can live inside a
    captured CUDA graph.

How: the dataset is padded once by `pad` zero pixels on each side (on the device, uint8). Each
epoch, one int64 per sample position packs (flip, offset y, offset x) (`epoch_table`). A step
gathers its samples' entries and reads the whole augmented batch with ONE advanced-indexing
gather `xp[i, :, oy + r, ox + c']` (c' mirrored where flipped), which also does the batch
selection. The result comes out (B, H, W, C) in memory: as an NCHW tensor it is channels_last.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from shmlearn.errors import BadInput

_M = 0x7FFFFFFF  # every intermediate stays below 2^62: int64 never overflows


def mix(a: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (LCG steps with xorshifts); same result on every device."""
    a = (a * 1103515245 + 12345) & _M
    a = a ^ (a >> 13)
    a = (a * 1664525 + 1013904223) & _M
    a = a ^ (a >> 17)
    a = (a * 1103515245 + 12345) & _M
    return a ^ (a >> 11)


@dataclass(frozen=True)
class Augment:
    flip: bool = False
    """Mirror left-right with probability 1/2."""
    translate: int = 0
    """Shift by up to this many pixels in x and y (uniform), filling with zeros."""

    @property
    def active(self) -> bool:
        return self.flip or self.translate > 0

    @staticmethod
    def parse(spec: Optional[str]) -> "Augment":
        """'none', 'flip', 'translate:2', 'flip,translate:2' (also 'crop:2', a synonym)."""
        if spec is None or spec.strip() in ("", "none"):
            return Augment()
        flip, shift = False, 0
        for part in (p.strip() for p in spec.split(",")):
            name, _, arg = part.partition(":")
            if name == "flip" and not arg:
                flip = True
            elif name in ("translate", "crop") and arg.isdigit() and int(arg) > 0:
                shift = int(arg)
            else:
                raise BadInput(f"--augment {spec}: expected none, flip, translate:N or both "
                               f"('flip,translate:2'); '{part}' is not one of them")
        return Augment(flip=flip, translate=shift)

    def __str__(self) -> str:
        parts = (["flip"] if self.flip else []) + ([f"translate:{self.translate}"] if self.translate else [])
        return ",".join(parts) or "none"

    # -- the device side ---------------------------------------------------------------------
    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """The dataset (N, C, H, W) uint8 with `translate` zero pixels on each side (done once)."""
        if x.dim() != 4:
            raise BadInput("--augment: only for image datasets (N, C, H, W)")
        p = self.translate
        return F.pad(x, (p, p, p, p)) if p else x

    def epoch_table(self, seed: int, epoch: int, n: int, device) -> torch.Tensor:
        """One int64 per position of the epoch: bit 0 flip, bits 8.. offset y, bits 16.. offset x
        (offsets in [0, 2*translate]: where the crop starts in the padded image)."""
        pos = torch.arange(n, dtype=torch.int64, device=device)
        h = mix(mix(torch.full((), seed & _M, dtype=torch.int64, device=device) + epoch) + pos)
        span = 2 * self.translate + 1
        flip = (h >> 3) & 1 if self.flip else torch.zeros_like(h)
        oy = (h >> 5) % span
        ox = (h >> 12) % span
        return flip | (oy << 8) | (ox << 16)

    def gather(self, xp: torch.Tensor, idx: torch.Tensor, table_entries: torch.Tensor,
               height: int, width: int) -> torch.Tensor:
        """Samples `idx` of the padded dataset xp, each cropped and flipped as its table entry
        says: (B, C, H, W) uint8 in channels_last memory, one gather kernel for the pixels."""
        dev = xp.device
        flip = (table_entries & 1).bool()
        oy = (table_entries >> 8) & 0xFF
        ox = (table_entries >> 16) & 0xFF
        r = torch.arange(height, device=dev)
        c = torch.arange(width, device=dev)
        cols = torch.where(flip[:, None], (width - 1) - c, c) + ox[:, None]   # (B, W)
        rows = oy[:, None] + r                                                # (B, H)
        out = xp[idx[:, None, None], :, rows[:, :, None], cols[:, None, :]]   # (B, H, W, C)
        return out.permute(0, 3, 1, 2)
