"""The gradient average overlapped with the backward, in buckets (--grad-buckets).

Without it the fast step's all-reduce starts when the backward has ended: the whole flat gradient
crosses the link while the GPU waits (resnet18's 45 MB at every step). With it, as DDP does, the
flat gradient buffer is cut into buckets of contiguous parameters, last parameters first (the
backward makes their gradients first); when the backward has made every gradient of a bucket,
that bucket's all-reduce starts on a stream of its own while the backward goes on with the
layers before it. The update then waits only for what is left in flight.

Each bucket is a contiguous slice of the strategy's flat buffer (with its control slots, which
ride in the first bucket: the loss is known before the backward starts), so the average is the
same sum over the ranks of the same values as the single all-reduce's, element by element; at
two ranks the same bits (a + b), at more ranks up to NCCL's order of summation.

Where gradients are taken whole (adopted, on CUDA), a bucket's gradients are copied into the
buffer on the bucket's stream just before its all-reduce, which waits for the backward's stream
and for the convolutions' deferred weight GEMMs (nn/conv_overlap.py) queued so far. Inside a
captured CUDA graph the same streams and waits are captured and replayed.

Not on a measured noise-scale step (|g_local|^2 needs the whole local gradient before the
average: that step averages after the backward, as without buckets), nor with fault injection
(it changes the loss after the backward). Under --compile the compiled backward hands every
gradient over at its end, so every bucket starts then: correct, but nothing overlaps, and
`auto` leaves buckets off there."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from shmlearn.nn import conv_overlap

BUCKET_MB = 25.0
"""Bucket size in MB (DDP's bucket_cap_mb default)."""
FIRST_BUCKET_MB = 1.0
"""The first bucket (the last layers' gradients, made first) is small, as DDP's is, so that
communication starts early in the backward."""


def plan(offsets: List[Tuple[int, int]], total: int, cap: int, first_cap: int) -> List[Tuple[int, int, List[int]]]:
    """Buckets over a flat buffer of `total` elements: offsets[i] = (start, numel) of parameter i's
    view. Parameters are taken from the buffer's end (the last parameters, whose gradients the
    backward makes first) until a bucket holds at least its cap in elements (first_cap for the
    first). Returns (lo, hi, parameter indices) per bucket, first bucket first; the first one
    reaches the buffer's end (the control slots after the gradients), the last one its start."""
    order = sorted(range(len(offsets)), key=lambda i: -offsets[i][0])
    buckets, hi, members, lo = [], total, [], total
    for i in order:
        members.append(i)
        lo = offsets[i][0]
        if hi - lo >= (first_cap if not buckets else cap):
            buckets.append((lo, hi, members))
            hi, members = lo, []
    if members:
        buckets.append((lo, hi, members))
    if buckets:  # the first parameter's start is the buffer's start
        lo0, hi0, m = buckets[-1]
        buckets[-1] = (0, hi0, m)
    return buckets


class GradBuckets:
    """One rank's bucketed gradient average for the fast step (module docstring). The strategy's
    gated_step calls `wait` where it would have averaged (`pending` says whether a bucketed
    average is under way this step); DeviceStep.gradients calls `begin` between the forward and
    the backward and `end` after it."""

    def __init__(self, strategy, *, cap_mb: float = BUCKET_MB, first_mb: float = FIRST_BUCKET_MB):
        s = self.s = strategy
        ext = s.grads_ext
        es = ext.element_size()
        base = ext.data_ptr()
        offsets = [((v.data_ptr() - base) // es, v.numel()) for v in s._grad_views]
        self.buckets = plan(offsets, ext.numel(), max(1, int(cap_mb * 2 ** 20) // es),
                            max(1, int(min(first_mb, cap_mb) * 2 ** 20) // es))
        """(lo, hi, parameter indices) of each bucket, in the order the backward fills them."""
        self._of = {}
        for b, (_, _, members) in enumerate(self.buckets):
            for i in members:
                self._of[i] = b
        self.device = ext.device
        self.cuda = ext.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=ext.device) if self.cuda else None
        self._live = False
        self.pending = False
        """Whether this step's average is under way in buckets (set by `begin`, cleared by `wait`)."""
        self._adopt = False
        self._left: List[int] = []
        self._src: List[list] = []
        self._dst: List[list] = []
        self._seen: List[bool] = []
        self._works: list = []
        self._keep: list = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(s._trainable)]

    def __len__(self) -> int:
        return len(self.buckets)

    def remove(self) -> None:
        """Unhook from the parameters (the run no longer averages in buckets)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin(self, loss: torch.Tensor, adopt: bool) -> None:
        """Before the backward: the control slots (zeros, then the loss last) into the buffer and
        every bucket armed. adopt: the backward's gradients are taken whole (release_grads ran),
        so each bucket copies them into the buffer before its all-reduce."""
        s = self.s
        for t, z in zip(s._tail, s._tail_zeros):
            t.copy_(z)
        s.grads_ext[-1:].copy_(loss.reshape(1))
        self._adopt = adopt
        self._left = [len(m) for _, _, m in self.buckets]
        self._src = [[] for _ in self.buckets]
        self._dst = [[] for _ in self.buckets]
        self._seen = [False] * len(s._trainable)
        self._works, self._keep = [], []
        self._live = self.pending = True

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self._live or self._seen[i]:
                return
            self._seen[i] = True
            b = self._of[i]
            if self._adopt:
                self._take(i, p.grad, b)
            self._left[b] -= 1
            if self._left[b] == 0:
                self._fire(b)
        return hook

    def _take(self, i: int, g: Optional[torch.Tensor], b: int) -> None:
        """Parameter i's gradient g (None: it got none, so zeros) goes into its view at the bucket's
        copy; .grad points at the view again, as adopt_grads leaves it."""
        s = self.s
        view = s._grad_views[i]
        s._trainable[i].grad = view
        if g is None:
            g = s._zeros.get(i)
            if g is None:
                g = s._zeros[i] = torch.zeros_like(view)
        elif g is not view:
            self._keep.append(g)  # read on the bucket's stream: alive until `wait` joins it
        if g is not view:
            self._src[b].append(g)
            self._dst[b].append(view)

    def _fire(self, b: int) -> None:
        lo, hi, _ = self.buckets[b]
        s = self.s
        chunk = s.grads_ext[lo:hi]
        op = s._avg_op if s._avg_op is not None else dist.ReduceOp.SUM
        if self.cuda:
            comm = self.stream
            comm.wait_stream(torch.cuda.current_stream(self.device))
            for side in conv_overlap.pending_streams(self.device):
                comm.wait_stream(side)  # deferred weight GEMMs still writing this bucket's gradients
            with torch.cuda.stream(comm):
                if self._src[b]:
                    torch._foreach_copy_(self._dst[b], self._src[b])
                self._works.append(dist.all_reduce(chunk, op=op, group=s.group, async_op=True))
        else:
            if self._src[b]:
                torch._foreach_copy_(self._dst[b], self._src[b])
            self._works.append(dist.all_reduce(chunk, op=op, group=s.group, async_op=True))

    def end(self) -> None:
        """After the backward (and its deferred GEMMs' join): a parameter the backward gave no
        gradient counts as zeros, and every bucket not yet started starts now."""
        if not self._live:
            return
        for i, seen in enumerate(self._seen):
            if not seen:
                self._seen[i] = True
                b = self._of[i]
                if self._adopt:
                    self._take(i, None, b)
                self._left[b] -= 1
                if self._left[b] == 0:
                    self._fire(b)
        self._live = False

    def wait(self) -> None:
        """The average done: the current stream waits for every bucket (Gloo, which has no AVG:
        then the sum divided by the ranks, as SyncStrategy._average_ does)."""
        for w in self._works:
            w.wait()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if self.s._avg_op is None:
            self.s.grads_ext.div_(self.s.world_size)
        self._works, self._keep = [], []
        self.pending = False
