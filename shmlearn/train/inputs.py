"""What one run trains: its dataset (kept on the device between the runs of one process, as a
sweep's pool worker runs them), its model (by name, or the user's own, checked once) and each
rank's loader."""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch
from torch.utils._pytree import tree_map

from shmlearn.config.train_config import TrainConfig
from shmlearn.data import Dataset, load_dataset, normalizer
from shmlearn.data.augment import Augment
from shmlearn.data.loader import ShardedLoader
from shmlearn.data.stream import StreamLoader, StreamedData, convert_batch
from shmlearn.data.host import HostTreeLoader, StreamTreeLoader, keeps_on_host, tree_bytes
from shmlearn.data.iterable import check_budget
from shmlearn.data.lazy import wanted as lazy_wanted
from shmlearn.data.tree import TreeData, TreeLoader, gather_parts, rows, rows_slice, tree_data
from shmlearn.data.user import first_item, user_data
from shmlearn.errors import BadInput
from shmlearn.models import build_model
from shmlearn.models.user import check_compute_loss, check_loss, check_outputs, user_model
from shmlearn.nn import FoldedLinear
from shmlearn.train import early
from shmlearn.user.parts import Parts, resolve_ref
from shmlearn.user.refs import is_ref

_DATA_CACHE: Dict[tuple, Dataset] = {}
_DATA_CACHE_SIZE = 2


def _make_room() -> None:
    """Drop the oldest cached datasets until one more fits (_DATA_CACHE_SIZE)."""
    while len(_DATA_CACHE) >= _DATA_CACHE_SIZE:
        _DATA_CACHE.pop(next(iter(_DATA_CACHE)))


def cached_dataset(name: str, data_dir: Optional[str], seed: int, device: torch.device, *,
                   task: Optional[str] = None, loader: str = "auto"):
    """The dataset on `device`, loaded once per process: a pool worker keeps it between a
    sweep's trials (reading and uploading Fashion-MNIST costs more than a short trial). Training
    never writes into it (the loader gathers batches into buffers of its own). `name` may be a
    reference to the user's own data (FILE.py:NAME)."""
    key = (name, os.path.abspath(data_dir) if data_dir else None, seed, str(device), task, loader)
    if key not in _DATA_CACHE:
        _make_room()
        if is_ref(name):
            ds = user_data(resolve_ref(name, "--dataset"), f"--dataset {name}", task=task, loader=loader,
                           device=device, name=name)
        else:  # read by this task's early thread (train/early.py) if it did, else here
            ds = early.take_dataset(name, data_dir, seed)
            if ds is None:
                ds = load_dataset(name, data_dir, seed=seed)
        _DATA_CACHE[key] = ds.to(device)
    return _DATA_CACHE[key]


def run_data(cfg: TrainConfig, parts: Parts, compute_loss, device: torch.device, rank: int, world: int):
    """This rank's data: the general contract's tree of the user's Datasets or --dataset reference
    (rank's part of each large split until gathered_loader), the user's arrays or Datasets, or the
    built-in dataset by name (cached)."""
    if compute_loss is not None and (parts.data is not None or is_ref(cfg.dataset)):
        return cached_tree_data(cfg, parts.data, device, rank, world)
    if parts.data is not None:
        return user_data(parts.data, "data=", task=cfg.task, loader=cfg.loader, device=device).to(device)
    return cached_dataset(cfg.dataset, cfg.data_dir, cfg.seed, device, task=cfg.task, loader=cfg.loader)


def cached_tree_data(cfg: TrainConfig, given, device: torch.device, rank: int = 0, world: int = 1) -> TreeData:
    """The general contract's data (data/tree.py) on `device`: the object given (data=), or the
    --dataset reference, collated once per process (a reference is cached as the built-in data is,
    once whole). Rank `rank` of `world` collates its part of each large split; the run completes
    them with gathered_loader once its process group exists."""
    lazy = lazy_wanted(cfg.loader, device)  # large splits read as training needs them (data/lazy.py)
    if given is not None:
        return _placed(cfg, tree_data(given, "data=", rank=rank, world=world, lazy=lazy), device, "data=")
    key = ("tree", cfg.dataset, str(device), cfg.loader)
    if key in _DATA_CACHE:
        return _budgeted(cfg, _DATA_CACHE[key], f"--dataset {cfg.dataset}")
    what = f"--dataset {cfg.dataset}"
    data = _placed(cfg, tree_data(resolve_ref(cfg.dataset, "--dataset"), what, name=cfg.dataset, rank=rank,
                                  world=world, lazy=lazy), device, what)
    if not data.pending:
        _make_room()
        _DATA_CACHE[key] = data
    return data


def _placed(cfg: TrainConfig, data: TreeData, device: torch.device, what: str) -> TreeData:
    """The tree's splits on the device, but a train split kept in host memory (--loader stream,
    or auto where it would take more than half the device's free memory: data/host.py) or given
    as a stream (which needs --samples: data/iterable.py)."""
    if data.stream is not None:
        return _budgeted(cfg, data.to(device), what)
    part = rows(data.train)
    nbytes = tree_bytes(data.train) * (data.parts.get("train", part) / max(part, 1))  # the whole split's
    return data.to(device, host_train=keeps_on_host(cfg.loader, int(nbytes), device))


def _budgeted(cfg: TrainConfig, data: TreeData, what: str) -> TreeData:
    """A stream's run: its budget is --samples (BadInput otherwise), which n_train then reads."""
    if data.stream is not None:
        check_budget(cfg.samples, what)
        data.stream_n = cfg.samples
    return data


def gathered_loader(cfg: TrainConfig, data, given, loader, augment, *, shard: int, num_shards: int,
                    device: torch.device, world: int):
    """(loader, augment) once the process group exists: in a run of several ranks, general-contract
    data some rank collated in parts is gathered (every rank takes part: data/tree.py
    gather_parts) and a --dataset reference's cached whole; its loader is built now where
    run_loader could not build it on a part."""
    if isinstance(data, TreeData) and world > 1:
        gather_parts(data, "data=" if given is not None else f"--dataset {cfg.dataset}")
        key = ("tree", cfg.dataset, str(device), cfg.loader)
        if given is None and key not in _DATA_CACHE:
            _make_room()
            _DATA_CACHE[key] = data
    if loader is None:
        return run_loader(cfg, data, shard=shard, num_shards=num_shards, device=device)
    return loader, augment


def host_fed(data) -> bool:
    """Whether training batches come from host memory (summary.json data_path "stream"): streamed
    (x, y) Datasets, a general-contract train split kept on the host, or a train stream."""
    return isinstance(data, StreamedData) or (isinstance(data, TreeData) and (data.host or data.stream is not None))


def preload_data(slot: int, datasets: list, cuda: bool) -> None:
    """Pool init (sweeps): load (name, data_dir, seed) onto this worker's device, into the cache."""
    device = torch.device("cuda", slot % torch.cuda.device_count()) if cuda else torch.device("cpu")
    for name, data_dir, seed in datasets:
        cached_dataset(name, data_dir, seed, device)


def run_model(cfg: TrainConfig, parts: Parts, data, compute_loss=None, loss=None):
    """(model, metric names): the config's model by name, or the user's, checked once on two
    training samples: its outputs' shape, or with compute_loss, that the function gives a finite
    scalar loss (and which metrics it reports); with the user's loss(outputs, targets), that it
    gives one (models.user.check_loss)."""
    if parts.model is None and not is_ref(cfg.model):
        model = build_model(cfg.model, data.spec, linear=FoldedLinear if cfg.folded_linear else torch.nn.Linear)
        what = f"--model {cfg.model}"
    else:
        what = "model=" if parts.model is not None else f"--model {cfg.model}"
        obj = parts.model if parts.model is not None else resolve_ref(cfg.model, "--model")
        model = user_model(obj, data.spec, what)
    names: tuple = ()
    if compute_loss is not None:
        fn = "compute_loss=" if parts.compute_loss is not None else f"--compute-loss {cfg.compute_loss}"
        names = check_compute_loss(model, compute_loss, two_batch(data), what, fn)
    elif parts.model is not None or is_ref(cfg.model):
        check_outputs(model, two_samples(data), data.spec, what)
    if loss is not None and compute_loss is None:
        x, y = two_batch(data)
        check_loss(model, loss, x, y, what, "loss=" if parts.loss is not None else f"--loss {cfg.loss}")
    return model, names


def two_batch(data):
    """The first two training samples on the CPU as the step gives them to compute_loss: the
    tree's rows, or the (normalized inputs, targets) pair of built-in and array data."""
    if isinstance(data, TreeData):
        return tree_map(lambda t: t.cpu(), rows_slice(data.train, 0, 2))
    if isinstance(data, StreamedData):
        x, y = convert_batch(*first_item(data.train, data.what, "train"), data.spec.task)
        return torch.stack([x] * 2), torch.stack([torch.as_tensor(y)] * 2)
    return two_samples(data), data.train_y[:2].cpu()


def two_samples(data) -> torch.Tensor:
    """Two training inputs on the CPU, as the model will see them (normalized, float)."""
    if isinstance(data, StreamedData):
        x = torch.stack([convert_batch(*first_item(data.train, data.what, "train"), data.spec.task)[0]] * 2)
    else:
        x = data.train_x[:2].cpu()
    return normalizer(data, torch.device("cpu"))(x)


def run_loader(cfg: TrainConfig, data, *, shard: int, num_shards: int, device: torch.device):
    """(this rank's loader, the parsed --augment): a StreamLoader for streamed data, else a
    ShardedLoader over the device-resident arrays (None for a tree held in parts, until
    gathered_loader). BadInput where --augment cannot run."""
    augment = Augment.parse(cfg.augment)
    if isinstance(data, TreeData):
        if augment.active:
            raise BadInput(f"--augment {cfg.augment}: augmentation is for the built-in image data; with "
                           f"compute_loss, augment in your function or Dataset")
        if data.pending:  # a part of the split: gathered_loader builds it once the parts are gathered
            return None, augment
        if data.stream is not None:
            return StreamTreeLoader(data.stream, device=device, batch_size=cfg.batch_size, shard=shard,
                                    num_shards=num_shards, accumulate=cfg.accumulate), augment
        lazy = data.lazy.get("train")  # rows read as the batches first need them (data/lazy.py)
        if data.host:
            return HostTreeLoader(data.train, device=device, batch_size=cfg.batch_size, shard=shard,
                                  num_shards=num_shards, seed=cfg.seed, sampler=data.sampler,
                                  accumulate=cfg.accumulate, lazy=lazy), augment
        return TreeLoader(data.train, batch_size=cfg.batch_size, shard=shard, num_shards=num_shards,
                          seed=cfg.seed, sampler=data.sampler, accumulate=cfg.accumulate, lazy=lazy), augment
    if augment.active and not data.spec.is_image:
        raise BadInput(f"--augment {cfg.augment}: {cfg.dataset} has no images to augment")
    if isinstance(data, StreamedData):
        if augment.active:
            raise BadInput(f"--augment {cfg.augment}: augmentation runs on device-resident images; this "
                           f"data is streamed (augment in your Dataset, or --loader resident)")
        loader = StreamLoader(data, batch_size=cfg.batch_size, shard=shard, timeout_s=cfg.timeout,
                              num_shards=num_shards, seed=cfg.seed, normalize=normalizer(data, device), device=device,
                              accumulate=cfg.accumulate)
    else:
        loader = ShardedLoader(data.train_x, data.train_y, batch_size=cfg.batch_size,
                               shard=shard, num_shards=num_shards, seed=cfg.seed,
                               normalize=normalizer(data, device), augment=augment,
                               channels_last=cfg.channels_last, accumulate=cfg.accumulate)
    return loader, augment
