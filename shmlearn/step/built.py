"""Which of shmlearn's Triton kernels are already built on this machine, for which shapes (issue 52,
"GPU cold start").

A first run on a machine with empty caches spent most of its time building kernels, not training:
alexnet-small on digits with default flags on one H200 (2026-11-28, `results/start-gpu-2026-11-28/`)
took 77 s of setup and 25.8 s of evaluation around 0.26 s of training, where the same run on
torch's ops took 8.5 s of setup and 0.13 s of evaluation. The time went to Triton compiling the
fused conv + ReLU + pool kernels and autotuning them for each new shape (the evaluation's batch of
1024 was a second set). Built once, they cost nothing: Triton keeps the binaries and the tuned
configurations in its cache folder, and the warm run's setup was 6.2 s.

So under `auto` a custom kernel runs where it is already built for the run's shapes on this device,
or where the run is long enough to be worth building for (`BUILD_MIN_STEPS`); otherwise the layers
keep torch's ops and summary.json's `kernels` says why. A run that built and ran the kernels leaves
a record here, keyed by everything the build depends on: the device's name and compute capability,
the driver, the Triton and torch versions, Triton's cache folder (a wiped or moved cache is a new
machine as far as builds go), the kernels' layers and the batch's shape and dtype. Forced kernels
(`--conv-pool triton`) always run, and build what they need.

The record is a file per key under `cache_dir()/kernels/`, written atomically; it is a hint, never
trusted for correctness: a kernel that fails still falls back at the probe (choice.probe).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Iterable, Iterator, Optional, Sequence, Tuple

import torch

from shmlearn.config.flags import cache_dir
from shmlearn.record import safe_write

BUILD_MIN_STEPS = 10_000
"""Under auto, a run of at least this many steps builds the kernels it lacks. A cold build is about a
minute of Triton compiling and autotuning (alexnet-small's three fused blocks on an H200, above),
which only a run of this many steps or more stops noticing; the build is then kept for every later
run on the machine. Shorter runs take torch's ops until something has built the kernels."""


_in_sweep = False
"""Whether this process runs a sweep's trial now (`sweep_trial`)."""


@contextlib.contextmanager
def sweep_trial() -> Iterator[None]:
    """Within: the run is one trial of a sweep, which builds no kernel under auto, whatever its
    length. A sweep compares its trials, so they should run the same ops: the build is keyed by
    the batch's shape, and on the seed's alexnet-sweep grid (four H200s, 2026-11-28,
    results/gpu-2026-11-28-b56/) the batch-16 trials alone were long enough to build, each of the
    four GPUs' first trial spent 74 s building, and only those trials then ran the fused kernels
    (the sweep's efficiency fell from 0.71 to 0.43). Kernels an earlier run built still run;
    forced ones (--conv-pool triton) build as always."""
    global _in_sweep
    before, _in_sweep = _in_sweep, True
    try:
        yield
    finally:
        _in_sweep = before


BUILDS_ENV = "SHMLEARN_KERNEL_BUILDS"
"""The environment variable that overrides the rule: `always` (auto builds what a run lacks, however
short: to build a machine's kernels once before a sweep, or to run the kernels in a test), `never`
(auto runs only what is built), unset or `auto` (the rule below)."""


def may_build(total_steps: int) -> bool:
    """Whether auto builds the kernels a run of `total_steps` steps lacks: runs of BUILD_MIN_STEPS
    or more, outside a sweep's trials (`sweep_trial`), unless BUILDS_ENV says always or never."""
    override = os.environ.get(BUILDS_ENV, "auto")
    if override in ("always", "never"):
        return override == "always"
    return not _in_sweep and total_steps >= BUILD_MIN_STEPS


def why_unbuilt(total_steps: int) -> str:
    """Why auto left a kernel that is not built here to torch, for the run's note."""
    if _in_sweep:
        return "a sweep's trials build none, so that its trials run the same ops"
    return f"{total_steps} steps are fewer than the {BUILD_MIN_STEPS} that build it"


def _driver() -> str:
    """The NVIDIA driver's version line (Linux), or "unknown"."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            return f.readline().strip()
    except OSError:
        return "unknown"


def _triton_cache() -> str:
    """Triton's cache folder: where the binaries and tuned configurations of a build live."""
    own = os.environ.get("TRITON_CACHE_DIR")
    if own:
        return os.path.abspath(own)
    return os.path.join(os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")


def key(layers: Iterable[str], shape: tuple, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """The record's key for kernels running on `layers` (their descriptions, shapes included) for
    input batches of `shape` and `dtype` on `device`, or None off CUDA or without Triton."""
    if device.type != "cuda":
        return None
    try:
        import triton  # lazy: optional, and only on CUDA
    except ImportError:
        return None
    props = torch.cuda.get_device_properties(device)
    parts = {"device": props.name, "capability": f"{props.major}.{props.minor}", "driver": _driver(),
             "triton": triton.__version__, "torch": torch.__version__, "triton_cache": _triton_cache(),
             "layers": sorted(layers), "shape": list(shape), "dtype": str(dtype)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _path(k: str) -> str:
    return os.path.join(cache_dir(), "kernels", f"{k}.json")


def is_built(k: Optional[str]) -> bool:
    """Whether a run on this machine built and ran the kernels of key k."""
    return k is not None and os.path.isfile(_path(k))


def mark_built(k: Optional[str], what: dict) -> None:
    """Record that the kernels of key k are built here (what: a readable note of them). A cache
    folder that cannot be written (read-only home, full disk) loses the hint, not the run."""
    if k is None:
        return
    try:
        os.makedirs(os.path.dirname(_path(k)), exist_ok=True)
        safe_write.write(_path(k), json.dumps(what, indent=1, sort_keys=True) + "\n", fsync=False)
    except OSError:
        pass


UPDATE_NOTE = ("the flat SGD update runs torch's fused SGD over the flat buffers, as its Triton kernel is not "
               f"built on this device for this model yet (a run of {BUILD_MIN_STEPS}+ steps builds it once; "
               "later runs use it)")


def update_backend(choices: Sequence[str], variant: str, numel: int, dtype: torch.dtype, device: torch.device,
                   total_steps: int) -> Tuple[str, Optional[str], Optional[str]]:
    """The flat SGD update's implementation (flat_sgd.backends' `choices`, the default first) under
    the rule above: its Triton kernel where it is built here for this variant (its constexprs:
    momentum, Nesterov, weight decay, the weight copy, the update in the backward) and this
    parameter layout, or where the run is long enough to build it; otherwise torch's fused SGD over
    the same buffers. A cold build of the kernel's variants (one per constexpr set and per
    alignment of the parameters updated one by one) was 8 Triton compiles, ~20 s of a 32 s first run
    of alexnet-small's 0.2 s of training (one H200, 2026-11-28, results/start-gpu-2026-11-28b/).
    Returns (backend, the record's key to mark once the kernel ran or None, a note or None)."""
    if choices[0] != "triton":
        return choices[0], None, None
    k = key([f"flat-sgd {variant}"], (numel,), dtype, device)
    if k is None or is_built(k) or may_build(total_steps):
        return "triton", k, None
    return "torch", None, UPDATE_NOTE
