"""shmlearn/step/compile.py cacheable_functions: a compiled step of torch's and shmlearn's modules,
conv_overlap's autograd.Function among them, is kept in AOTAutograd's cache, so that the next
process that compiles the same step reads it instead of tracing and partitioning its joint graph
again (issue 52); a model with a user's module keeps torch's default (the graph bypasses the cache).

Each compile runs in a fresh process (Dynamo's and AOTAutograd's in-memory state would answer
a second compile in this one), on one cache folder for the module: torch's counters say what each
did. The user's step shares the folder with ours (whichever runs first): it still bypasses
AOTAutograd's cache, and Inductor's kernels built for our step are read for it (~9 s against ~19 s
built afresh on 2 cores)."""
import json
import os
import subprocess
import sys

import pytest

from inductor import skip_unbuilt

SCRIPT = r"""
import json, sys
import torch
from torch import nn
from shmlearn.nn import conv_overlap
from shmlearn.step.compile import build_failure, cacheable_functions


class Users(nn.Module):  # a module of the user's own (this script's __main__)
    def forward(self, x):
        return x * 2


torch.manual_seed(0)
layers = [nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)]
if sys.argv[1] == "user":
    layers.insert(0, Users())
model = nn.Sequential(*layers)
conv_overlap.convert(model, "all")


def step(x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
try:
    with cacheable_functions(model):
        torch.compile(step, dynamic=False)(x, y)
except Exception as e:
    if build_failure(e) is None:
        raise
    print(json.dumps({"unbuilt": str(e)[:200]}))
    sys.exit(0)
from torch._dynamo.utils import counters
print(json.dumps(dict(counters["aot_autograd"])))
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The module's cache folder (Inductor's and AOTAutograd's, Triton's)."""
    return tmp_path_factory.mktemp("compile-cache")


def _compile(tmp_path, kind: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"), TORCHINDUCTOR_COMPILE_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, kind], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "unbuilt" in got:
        skip_unbuilt(got["unbuilt"])
    return got


def test_a_step_of_ours_is_read_from_the_cache(cache):
    torch = pytest.importorskip("torch")
    from torch._functorch import config
    if not hasattr(config, "autograd_cache_allow_custom_autograd_functions"):
        pytest.skip("this torch has no autograd_cache_allow_custom_autograd_functions")
    first = _compile(cache, "ours")
    assert first.get("autograd_cache_miss") == 1 and first.get("autograd_cache_saved") == 1, first
    second = _compile(cache, "ours")
    assert second.get("autograd_cache_hit") == 1 and not second.get("autograd_cache_miss"), second


def test_a_step_with_a_users_module_keeps_torchs_default(cache):
    got = _compile(cache, "user")
    # conv_overlap's Function is in the graph: torch's default leaves it out of the cache (so a
    # second process could not read it either)
    assert got.get("autograd_cache_bypass") == 1 and not got.get("autograd_cache_saved"), got
