"""The run's own section of its config (RunOptions): the processes (workers, device, backend,
threads), the budget, the seed, the run directory and what is written into it, checkpoints,
timeouts and the gradient-noise measurement. Its readers are the launcher, the loop and the
recorder (launch/, train/, record/); it lives here because no one of them owns it.
TrainConfig is composed of it (config/train_config.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from shmlearn.config.flags import Section


@dataclass(kw_only=True)
class RunOptions(Section):
    """The processes, the budget, the run directory, checkpoints and what is measured."""

    workers: Optional[int] = None
    """Gradient-computing workers. Local default 2; under torchrun/mpirun/srun the launcher's world
    size (minus one with --ps-dedicated or async-ps: the server)."""
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """cpu, cuda (one process per GPU, NCCL) or auto (cuda when present)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """How the processes talk: auto (NCCL on GPUs, Gloo on the CPU), nccl, or gloo. gloo on GPUs
    lets processes share a GPU (collectives through host memory): e.g. an async-ps server and
    two workers on one GPU."""
    shared_memory: Literal["auto", "off"] = "auto"
    """CPU runs: the ranks of one host exchange gradients and weights (allreduce, weight-avg, ps,
    and async-ps's messages) through shared memory (/dev/shm) instead of Gloo's TCP, ~10x faster
    for a small model's gradient; auto where they can (else Gloo, with a note in summary.json),
    off: Gloo always."""
    threads: Optional[int] = None
    """Intra-op CPU threads per worker. Default on the CPU: the cores divided among the processes,
    at least 1; on GPUs at most 4 (limits.GPU_RANK_THREADS: a GPU's rank needs few, and more made
    the ranks of one host slow each other's steps)."""
    oversubscribe: bool = False
    """Run more local CPU processes than the machine can hold well (more than 16 per core, or
    more than its available memory at ~150 MB each), or more than 4 threads per core; refused
    otherwise, before any process starts."""
    deterministic: bool = False
    """Bitwise-reproducible numerics: on CUDA deterministic cuDNN convolutions (no autotuning) and
    torch's deterministic algorithms (a warning for an op that has none), usually slower; on the
    CPU a rank's threads are its share of the cores whatever the load (limits.rank_threads: by
    default a busy machine takes threads away, and another thread count changes the bits). Two
    runs of a config on one machine then give the same losses, so runs compare by their settings,
    not by chance."""
    samples: Optional[int] = None
    """Sample budget: training samples seen by all workers together; steps = samples // (workers *
    batch * accumulate)."""
    epochs: Optional[float] = None
    """Instead of --samples: passes over the training set. Default per dataset: digits 20,
    fashion-mnist/mnist 2, cifar10/tiny-imagenet/synthetic 10, step 1, line 20."""
    seed: int = 0
    """Seed for weights, data order and augmentation; shared by all ranks."""
    timeout: float = 300.0
    """Seconds a collective may wait, or a lone worker stay inside one step, before the run is
    brought down naming the rank."""
    out: Optional[str] = None
    """Run directory. Default runs/<date>-<model>-<dataset>-<strategy>-w<workers>."""
    resume: bool = False
    """Continue the run in --out from its newest good checkpoint (start fresh if it has none)."""
    checkpoint_every: Optional[Union[int, str]] = None
    """Checkpoint every N steps ("200") or every N seconds of training ("30s"); also at the end."""
    log_every: int = 10
    """Write a metrics.jsonl line every this many steps (and at the last). Logging only: every
    step's loss is kept (loss area, min loss) and checked for NaN/inf either way, read from the
    device every --check-every steps."""
    progress: bool = True
    """Rank 0's progress bar on stderr, on by default; --no-progress turns it off."""
    save_model: bool = True
    """The final weights are saved in the run directory, by default: model.safetensors (with the
    safetensors package) or model.pt, which shmlearn.load_model(RUN_DIR) returns as the trained
    module; --no-save-model skips them."""
    tensorboard: bool = False
    """Also write TensorBoard event files in RUN/tensorboard/ (rank 0): loss, lr, samples/s, phase
    seconds, test loss and accuracy; a sweep's trials are runs of one log dir (tensorboard
    --logdir SWEEP_DIR). Needs pip install 'shmlearn[tensorboard]'."""
    noise_scale: bool = False
    """Measure the gradient noise scale B_simple = tr(Sigma)/|G|^2 (McCandlish et al. 2018) as
    training runs: each rank adds its local gradient's squared norm to the gradient collective
    the step already makes (allreduce, ps; at 1 worker every strategy, each batch computed as two
    halves). metrics.jsonl and summary.json get the estimates; docs/noise-scale.md."""
    noise_every: Optional[int] = None
    """With --noise-scale: measure every this many steps (steps 0, K, 2K, ...); the others run
    as without it. Default 50 at 1 worker, 10 at 2+ (noise.default_every): what keeps the cost
    under 2% of the step time. A measured step costs most at 1 worker (two half batches) and
    little at 2+ (two norms and one float in the collective; docs/performance.md, "Behind the
    code"); 1 gives every step's estimate (and that cost), fewer measurements give a
    noisier estimate (docs/noise-scale.md)."""
