"""Custom ops defined on first use, shared by the fused modules (conv_pool, image_conv, mlp_head,
conv_overlap)."""
from __future__ import annotations

from typing import Any, Callable


class OnFirstUse:
    """Calling it returns define()'s result, computed on the first call. Defining the custom ops
    imports torch.utils.flop_counter (and with it Triton), which runs that use none of them need
    not pay for. A plain object with an attribute, not functools.cache: the forwards call it while
    Dynamo traces, and Dynamo inlines this call as it read the module globals before."""

    def __init__(self, define: Callable[[], Any]):
        self.define = define
        self.value = None

    def __call__(self):
        if self.value is None:
            self.value = self.define()
        return self.value
