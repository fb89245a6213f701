"""Which layers run shmlearn's custom kernels, decided from what the device can really run, and a
first forward and backward that proves it before the run depends on it.

Two stages, both per layer:
1. `choose`: each kernel's own check (conv_pool.block_why_not, mlp_head.head_why_not) of the
   layer's shape and dtype against the device's limits (fit.py: shared memory a block and the
   architecture, against Triton's compiled metadata). A layer that fails keeps torch's ops; under
   "auto" the run goes on and says why, a forced kernel (`--conv-pool triton`) is a BadInput
   naming the flag, the layer and the reason.
2. `probe`: where any layer took a kernel, one forward and backward of the model on a real batch
   (autograd.grad: no .grad written; buffers and RNG states restored, so the run trains exactly
   as without it). A kernel that still fails to compile or launch there is switched off for the
   rest of the run, with a note, and the probe runs again: a custom kernel never fails a run.

Every decision is a `Choice` (layer, kernel, path, why), recorded in summary.json's `kernels`.
"""
from __future__ import annotations

import dataclasses
import traceback
from typing import Callable, Collection, Dict, List, Optional

import torch
from torch import nn

from shmlearn.errors import BadInput, one_line
from shmlearn.nn import conv_pool, image_conv, mlp_head


@dataclasses.dataclass
class Choice:
    layer: str
    kernel: str
    """conv-pool, mlp-head or image-conv."""
    path: str
    """triton (shmlearn's kernel) or torch (torch's ops)."""
    why: Optional[str] = None
    """Why torch where the kernel was asked for (auto or forced), None where it runs."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


FLAGS = {"conv-pool": "--conv-pool", "mlp-head": "--mlp-head", "image-conv": "--image-conv"}


def _names(model: nn.Module) -> Dict[int, str]:
    return {id(m): (n or "model") for n, m in model.named_modules()}


def choose(model: nn.Module, *, conv_pool_mode: str, mlp_head_mode: str, dtype: torch.dtype,
           device: torch.device, unchecked: Collection[str] = (), convert: bool = True) -> List[Choice]:
    """Convert the model's conv-pool blocks and MLP heads (modes already resolved: off or
    triton) where their kernels run on device for inputs of dtype; the choices made. A block or
    head that cannot run is left to torch; where its mode was forced (the caller passes the
    user's flag value through `forced`) see `check_forced`. unchecked: kernels whose fit on the
    device is not checked (no compile), as their caller will not run them unless it checks
    again (step/kernels.py choose). convert False: the choices only, the model left as it is
    (converting defines the kernels' torch ops, whose Triton wrapper imports torch._dynamo)."""
    names = _names(model)
    out: List[Choice] = []
    if conv_pool_mode == "triton":
        fits = "conv-pool" not in unchecked
        whys = {id(b[0]): conv_pool.block_why_not(b[0], dtype, device, fits) for b in conv_pool.blocks(model)}
        if convert:
            conv_pool.convert(model, "triton", check=lambda conv: whys.get(id(conv)))
        for conv, _, _ in conv_pool.blocks(model):
            why = whys.get(id(conv))
            out.append(Choice(f"{names[id(conv)]} ({conv_pool.describe(conv)})", "conv-pool",
                              "torch" if why else "triton", why))
    if mlp_head_mode == "triton":
        chains = mlp_head.heads(model)
        whys = {id(c[0]): mlp_head.head_why_not(c, dtype, device, "mlp-head" not in unchecked) for c in chains}
        if convert:
            mlp_head.convert(model, "triton", check=lambda chain: whys.get(id(chain[0])))
        for chain in chains:
            why = whys.get(id(chain[0]))
            out.append(Choice(f"{names[id(chain[0])]} ({mlp_head.describe(chain)})", "mlp-head",
                              "torch" if why else "triton", why))
    return out


def check_forced(choices: List[Choice], forced: Dict[str, bool], device_name: str) -> None:
    """A kernel the user forced (`forced[kernel]`) that some layer cannot run: exit 2, one line."""
    for c in choices:
        if forced.get(c.kernel) and c.path != "triton" and c.why and "bf16 or fp16 only" not in c.why:
            raise BadInput(f"{FLAGS[c.kernel]} triton: {c.layer} cannot run shmlearn's kernel on {device_name} "
                           f"({c.why}); use {FLAGS[c.kernel]} auto (torch's ops where it cannot) or off")


def _culprit(err: BaseException) -> Optional[str]:
    """Which kernel's code raised err (from the traceback's files), or None."""
    files = " ".join(f.filename for f in traceback.extract_tb(err.__traceback__))
    for kernel, mark in (("conv-pool", "_conv_pool_triton"), ("mlp-head", "_mlp_head_triton"),
                         ("image-conv", "_image_conv_triton")):
        if mark in files:
            return kernel
    text = f"{type(err).__name__} {err}"
    return "any" if ("triton" in text.lower() or "OutOfResources" in text) else None


def switch_off(model: nn.Module, kernel: str) -> int:
    """Every layer that runs `kernel` back on torch's ops; how many."""
    if kernel == "conv-pool":
        n = len([b for b in conv_pool.blocks(model) if type(b[0]) is conv_pool.ConvReluPool2d])
        conv_pool.convert(model, "off")
        return n
    if kernel == "mlp-head":
        n = len([c for c in mlp_head.heads(model) if type(c[0]) is mlp_head.MLPHead])
        mlp_head.convert(model, "off")
        return n
    if kernel == "image-conv":
        n = sum(m.__dict__.get("image_conv") == "triton" for m in model.modules())
        image_conv.convert(model, "cudnn")
        return n
    return 0


def running(model: nn.Module) -> List[str]:
    """The custom kernels some layer of model runs now."""
    found = []
    if any(type(b[0]) is conv_pool.ConvReluPool2d for b in conv_pool.blocks(model)):
        found.append("conv-pool")
    if any(type(c[0]) is mlp_head.MLPHead for c in mlp_head.heads(model)):
        found.append("mlp-head")
    if any(m.__dict__.get("image_conv") == "triton" for m in model.modules()):
        found.append("image-conv")
    return found


def probe(model: nn.Module, batch: Callable[[], tuple], loss: Callable, autocast: Callable,
          device: torch.device) -> List[str]:
    """Run one forward and backward of model where it runs custom kernels; a kernel that fails
    is switched off (`switch_off`) and the probe repeated. Returns one note per kernel switched
    off; raises what fails with no custom kernel to blame. Leaves no trace in the run: gradients
    through autograd.grad (no .grad, no hooks on accumulation), buffers (BatchNorm's statistics)
    and RNG states (dropout) restored."""
    notes: List[str] = []
    while running(model):
        try:
            _one_pass(model, batch, loss, autocast, device)
            return notes
        except Exception as e:  # noqa: BLE001 - a kernel that fails falls back, anything else is raised
            kernel = _culprit(e)
            if kernel is None:
                raise
            kernels = running(model) if kernel == "any" else [kernel]
            for k in kernels:
                switch_off(model, k)
                notes.append(f"{FLAGS[k]}: shmlearn's kernel failed on this device ({one_line(e)}); "
                             f"torch's ops run those layers")
            if torch.cuda.is_available() and device.type == "cuda":
                torch.cuda.synchronize(device)
    return notes


def _one_pass(model, batch, loss, autocast, device) -> None:
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    params = [p for p in model.parameters() if p.requires_grad]
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, enabled=True):
            x, y = batch()
            with autocast():
                out = model(x)
            value = loss(out, y)
            torch.autograd.grad(value, params, allow_unused=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        with torch.no_grad():
            bufs = dict(model.named_buffers())
            for n, b in saved.items():
                bufs[n].copy_(b)
