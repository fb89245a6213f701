"""A run of the `shmlearn` program in its own process that compiles nothing imports no torch._dynamo
(issue 52, warm start).

Why: torch._dynamo is ~800 modules, imported by the first call of any torch.optim.Optimizer
method that torch marks "not for Dynamo" (`torch._disable_dynamo`: add_param_group, which every
optimizer's constructor calls, zero_grad, state_dict, load_state_dict) and by every
optimizer.step() (its `_use_grad` wrapper). Where nothing compiles, Dynamo has nothing to stay out
of, and the import is pure cost: 1.1 s of `import torch`'s 1.1 s more on this 2-core CPU with
bytecode caches, and 6.5 s on an H200 host whose image sets PYTHONDONTWRITEBYTECODE (a default
one-GPU alexnet-small run took 10.9 s warm there against a floor of 4.2-5.3 s for `import torch`
and a CUDA context; results/start-gpu-2026-11-28b/).

What `skip_dynamo_in_optimizers` does: it hands each such method the cache torch's wrapper reads
before it imports Dynamo (the function itself, in the attribute the wrapper would fill with
`torch._dynamo.disable(fn)`), so the methods run as they are written; and it makes
`torch._disable_dynamo` return what it is given from then on, so that the custom ops this run
defines later (torch.library.custom_op wraps each kernel in it: shmlearn's convolution backward on
CUDA, nn/conv_overlap.py) do not import Dynamo at their first call either (on the H200 host the
warm run still imported it there, 6.1 s of its 10.9). Only in the program's own
process (never a user's script: its later code may compile a step that calls them), for a run
with --compile off, once. The fast step never calls optimizer.step() (it updates through fused
kernels, step/); the probe of torch's fused optimizers calls the unwrapped step
(step/options.py fused_why_not), and launch.import_before_group imports Dynamo only where this
module did not step in. A torch whose wrapper differs (another attribute, no __wrapped__) is left
alone: Dynamo is then imported as before, nothing else changes.
"""
from __future__ import annotations

import sys

METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
"""torch.optim.Optimizer's methods under torch._disable_dynamo (torch 2.4-2.13)."""
CACHE = "__dynamo_disable"
"""The attribute torch._disable_dynamo's wrapper reads on the function it wraps, and imports
torch._dynamo to fill when it is missing."""

_active = False


def skip_dynamo_in_optimizers() -> bool:
    """Let torch.optim.Optimizer's Dynamo-disabled methods run without importing torch._dynamo
    (the module docstring says where this is safe); True if done now or before. Does nothing where
    torch._dynamo is already imported (there is nothing left to save) or the wrappers are not
    torch's usual ones."""
    global _active
    if _active:
        return True
    if "torch._dynamo" in sys.modules:
        return False
    import torch
    plain = []
    for name in METHODS:
        wrapper = getattr(torch.optim.Optimizer, name, None)
        fn = getattr(wrapper, "__wrapped__", None)
        code = getattr(wrapper, "__code__", None)
        if fn is None or code is None or CACHE not in code.co_names:
            return False
        plain.append(fn)
    for fn in plain:
        setattr(fn, CACHE, fn)
    torch._disable_dynamo = _as_given
    _active = True
    return True


def _as_given(fn=None, recursive: bool = True):
    """torch._disable_dynamo where nothing compiles: the function itself (also as a decorator
    with arguments, @torch._disable_dynamo(recursive=False))."""
    if fn is None:
        return lambda f: f
    return fn


def active() -> bool:
    """Whether this process runs its optimizers without torch._dynamo (skip_dynamo_in_optimizers)."""
    return _active


USER_CODE = ("model", "dataset", "loss", "compute_loss", "optimizer", "scheduler")
"""The fields of a TrainConfig that may name the user's code (FILE.py:NAME, user/refs.py)."""


def compiles_nothing(cfg) -> bool:
    """Whether a run of TrainConfig `cfg` may run on a lean pool (launch.pool.Pool's lean: no
    torch._dynamo in its workers): it does not compile, and it imports none of the user's code
    (which might). CPU or GPU: the program's GPU pools fork from a forkserver that imported torch
    alone (cli.prestart); a pool forked from one that also imported Dynamo only loses the time."""
    from shmlearn.user.refs import is_ref  # lazy: the program reads this module before its other imports
    return cfg.compile == "off" and not any(is_ref(getattr(cfg, f)) for f in USER_CODE)

