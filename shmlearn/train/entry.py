"""The entry of a run: `train()` (the public API), `rank_main` (a rank in a pool worker) and
`run_worker` (a rank under torchrun/mpirun/srun, or called directly).

The run's checks happen here, once, before any worker starts: the config is validated, its
workers are resolved (`settle`: the given --workers or the default for the devices present; under
a launcher, the computing ranks among the processes it started) and the layout is checked. The
ranks then receive a settled config (rank.py builds them, loop.py trains them); a rank that
receives an unsettled one (a sweep's trial, a direct call) validates and settles it itself.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import time
from dataclasses import replace
from typing import Optional

import torch

from shmlearn.config.train_config import TrainConfig, validate
from shmlearn.data import check_present
from shmlearn.data.iterable import check_budget, given_stream
from shmlearn.errors import BadInput, Diverged, WorkerFailed, count
from shmlearn.user import user_main
from shmlearn.launch.placement import backend_for, default_workers, device_type
from shmlearn.launch.pool import current as current_pool, describe, run_local
from shmlearn.launch.start import DistEnv, check_capacity, detect_env, free_port
from shmlearn.launch import lean
from shmlearn.train import early
from shmlearn.step import built
from shmlearn.record.runs import check_out_dir, default_run_dir, lock_out_dir, published
from shmlearn.sync import registry
from shmlearn.train import checkpoint as ckpt
from shmlearn.train import noise
from shmlearn.train.rank import run_rank
from shmlearn.train.result import RunResult
from shmlearn.user import recipe
from shmlearn.user.parts import Parts, resolve_ref
from shmlearn.user.refs import is_ref

__all__ = ["RunResult", "train", "rank_main", "trial_main", "run_worker", "settle"]


def train(cfg: TrainConfig, model=None, data=None, loss=None, compute_loss=None, optimizer=None,
          scheduler=None) -> RunResult:
    """Train as the config says: spawn local workers, or be one rank under a launcher.

    model: an nn.Module (its weights are every rank's starting point), or a class or callable
    returning one (called with the DataSpec if it has a required positional parameter); default
    the config's `model`. data: (train_x, train_y, test_x, test_y) arrays or tensors, used as
    given, or a pair of map-style torch Datasets (train, test), or a callable returning either;
    default the config's `dataset`. loss: f(outputs, targets) -> mean loss; default the task's.
    compute_loss: the general contract, f(model, batch) -> loss or (loss, {name: value}), for any
    model and data: `data` is then (train, test) or (train, val, test) Datasets whose items have any
    structure (data/tree.py), batch is a batch of them collated on the device, and evaluation
    reports the mean loss and each metric (test_loss, test_NAME; val_loss, val_NAME).
    optimizer: a torch.optim.Optimizer class (called with the model's parameters) or a callable
    called with the model (parameter groups) returning an Optimizer; default the config's.
    scheduler: a callable optimizer -> LRScheduler, stepped per epoch or per step as
    cfg.scheduler_interval says (recipe.py). Local workers receive these pickled: define them at
    the top level of your script (functools.partial of such is fine).

    Raises BadInput (exit 2), Diverged (exit 3) or WorkerFailed (exit 1)."""
    user_main.stop_if_importing()  # a pool worker running the script stops here (user_main.py)
    parts = Parts(model, data, loss, optimizer, scheduler, compute_loss)
    cfg = parts.labelled(cfg)  # before validation: the labels are what config.yaml records
    validate(cfg)
    recipe.check_refs(cfg, parts)  # a wrong --optimizer/--scheduler/--loss fails here, before any process
    if compute_loss is not None and given_stream(data):  # an endless train stream needs --samples
        check_budget(cfg.samples, "data=")
    env = detect_env()
    if env is not None:
        cfg = settle(cfg, registry.spec(cfg), processes=env.world_size)
        return run_worker(cfg, env, parts=parts, settled=True)
    if model is None and is_ref(cfg.model):  # a wrong FILE.py:NAME fails here, before any process
        resolve_ref(cfg.model, "--model")
    if data is None and is_ref(cfg.dataset):
        resolve_ref(cfg.dataset, "--dataset")
    elif data is None:  # a missing --data-dir or file: one line now, not after the workers start
        check_present(cfg.dataset, cfg.data_dir)
    cuda = device_type(cfg.device) == "cuda"
    spec = registry.spec(cfg)
    cfg = settle(cfg, spec)
    world = spec.processes(cfg.workers)
    backend = backend_for(cfg, cuda)
    if cuda and world > torch.cuda.device_count() and backend == "nccl":
        extra = f" + {count(spec.servers, 'server')}" if spec.servers else ""
        raise BadInput(f"--workers {cfg.workers}: {world} processes ({count(cfg.workers, 'worker')}{extra}) need "
                       f"{world} GPUs, {torch.cuda.device_count()} present (--backend gloo shares GPUs)")
    if not cfg.resume and cfg.out:
        check_out_dir(cfg.out)
    if not cuda:
        check_capacity(world, cfg.threads, cfg.oversubscribe)
    cfg = replace(cfg, out=cfg.out or default_run_dir(cfg, cfg.workers, claim=True))
    with lock_out_dir(cfg.out):  # BadInput if --out cannot be written, or another run writes there
        if cfg.resume and (done := ckpt.finished(cfg.out)) is not None:  # never rewritten
            return RunResult(status="completed", run_dir=cfg.out, summary=done)
        if world == 1 and current_pool() is None:
            if user_main.in_program() and cfg.compile == "off":  # nothing here compiles: no Dynamo
                lean.skip_dynamo_in_optimizers()
            caller_threads = torch.get_num_threads()  # the rank sets its own; the caller keeps its
            try:
                result = run_worker(cfg, DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                                                 launcher="local", master_port=free_port()),
                                    parts=parts, settled=True)
            except (BadInput, Diverged, WorkerFailed, KeyboardInterrupt):
                raise
            except (Exception, SystemExit) as e:  # noqa: BLE001 - one line naming the rank, as with 2+ workers
                raise WorkerFailed(f"rank 0: {describe(e)}") from e
            finally:
                torch.set_num_threads(caller_threads)
            # On the CPU, as rank_main sends it: on the GPU its parameters view the strategy's flat buffer.
            model = copy.deepcopy(result.model).cpu() if result.model is not None else None
            return replace(result, model=model)
        sent = parts.pickled() if parts.given() else None
        cfg_dict = cfg.to_dict()
        # A run that compiles nothing and runs none of the user's code: its workers never import
        # torch._dynamo (launch/lean.py; cli.prestart started no forkserver, or one without it).
        # From a script too: the pool's workers, forked from it or from the forkserver, are its
        # own processes, and the optimizers' patch (lean.skip_dynamo_in_optimizers) stays in them.
        lean_pool = not parts.given() and lean.compiles_nothing(cfg)
        summary, run_dir, blob = run_local(rank_main, (cfg_dict, None, True, sent, True), world,
                                           cuda=cuda, timeout_s=cfg.timeout, backend=backend,
                                           threads=cfg.threads, rank_threads=True,
                                           early=None if parts.given() else early.task_early(cfg_dict),
                                           lean=lean_pool)[0]
    # The whole module (the user's class), so not weights_only: bytes rank 0 of this run sent over
    # its pool's pipe, never read from a file (docs/security.md).
    model = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False) if blob else None
    return RunResult(status=summary["status"], run_dir=run_dir, summary=summary, model=model)


def rank_main(env: DistEnv, cfg_dict: dict, prune_key: Optional[str] = None, want_model: bool = False,
              parts: Optional[bytes] = None, settled: bool = False):
    """One rank of a local run, in a pool worker: rank 0 returns (summary, run_dir, the trained
    model on the CPU as torch.save bytes, or None). Bytes, not the module: its parameters are
    views into one flat device buffer, and a pipe would try to share them. parts: the user's
    model/data/loss, pickled (parts.py). settled: as run_worker's (train() settled the config)."""
    result = run_worker(TrainConfig(**cfg_dict), env, prune_key=prune_key, parts=Parts.unpickled(parts),
                        settled=settled)
    if env.rank != 0:
        return None
    blob = None
    if want_model and result.model is not None:
        buf = io.BytesIO()
        torch.save(copy.deepcopy(result.model).cpu(), buf)
        blob = buf.getvalue()
    return result.summary, result.run_dir, blob


def trial_main(env: DistEnv, cfg_dict: dict, prune_key: Optional[str] = None):
    """One rank of a sweep's trial, in a pool worker: rank_main, building no kernel under auto
    (step/built.py sweep_trial: a sweep's trials run the same ops), into a run directory that the
    sweep publishes and fsyncs (record/runs.py published; sweeps/trials.py done)."""
    with built.sweep_trial(), published():
        return rank_main(env, cfg_dict, prune_key)


def settle(cfg: TrainConfig, spec: registry.Spec, *, processes: Optional[int] = None) -> TrainConfig:
    """The run's workers, resolved once, and the checks of its layout, run once; returns cfg with
    `workers` set. processes None (a local run, whose processes train() starts): the given
    --workers, or the default for the devices present. processes P (started by a launcher or a
    pool): the computing ranks among them, which a given --workers must match."""
    if processes is None:
        workers = cfg.workers
        if workers is None:
            cuda = device_type(cfg.device) == "cuda"
            workers = default_workers(cuda, torch.cuda.device_count() if cuda else 0, spec.servers)
    else:
        workers = spec.compute_ranks(processes)
        if workers < 1:
            raise BadInput(f"{spec.flags()}: needs at least {spec.processes(1)} processes "
                           f"({count(spec.servers, 'server')} + 1 worker)")
        if cfg.workers is not None and cfg.workers != workers:
            servers = f" + {count(spec.servers, 'server')}" if spec.servers else ""
            raise BadInput(f"--workers {cfg.workers}: the launcher started {processes} processes "
                           f"({count(workers, 'worker')}{servers}); drop --workers or match it")
    noise.check(cfg, spec, workers)
    return replace(cfg, workers=workers)


def run_worker(cfg: TrainConfig, env: DistEnv, *, prune_key: Optional[str] = None,
               parts: Optional[Parts] = None, settled: bool = False) -> RunResult:
    """One rank's run. prune_key (sweeps with --prune): where the sweep posts the bound this run
    must beat (pruning.py). parts: the user's own model/data/loss objects, if any. settled: cfg
    was validated and settled for the run already (train() does both, once); else this rank does."""
    t_entry = time.perf_counter()
    if not settled:
        validate(cfg)
        cfg = settle(cfg, registry.spec(cfg), processes=env.world_size)
    spec = registry.spec(cfg)
    cfg = replace(cfg, out=cfg.out or default_run_dir(cfg, cfg.workers))
    # Elastic restart: torchrun starts the same command again; it must continue, not restart.
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        cfg = replace(cfg, resume=True)
    if env.rank == 0 and env.launcher != "local" and not cfg.resume:
        check_out_dir(cfg.out)
    # Under torchrun/mpirun/srun rank 0 holds --out's lock for the run (locally, train() does).
    out_lock = lock_out_dir(cfg.out) if env.rank == 0 and env.launcher != "local" else contextlib.nullcontext()
    with out_lock:
        return run_rank(cfg, env, spec, prune_key, t_entry, parts or Parts())
