"""recipes/: each config is TrainConfig fields that validate, says what it aims at, and runs
through `shmlearn train --config` (flags on the command line win, a --samples included over the
recipe's epochs); and the fashion recipes train exactly what benchmarks/fashion_tta.py measured.

The equivalence test runs the benchmark's own _train_one (its network, optimizer, schedule,
label-smoothed loss and augmentation, on shmlearn's step) and `shmlearn.train` with the recipe
file's config, on the same small slice of Fashion-MNIST, seed, step count and batch (a 64th of
the recipes'), on the CPU: every step's loss and the final test accuracy must be equal. What
it cannot cover: the GPU-only parts (the CUDA graph and cuDNN's algorithm choice; precision,
channels_last and the step code are the same on both sides), and the recipes' full length (1875
steps of fashion-94 against the benchmark's 1872: shmlearn counts 16 x 60,000 samples, the
benchmark 16 x 117 whole batches).
"""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import shmlearn
from shmlearn.config.train_config import TrainConfig, load_yaml, validate
from shmlearn.data.idx import load_idx_pair

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
FASHION_DIRS = [ROOT / "data" / "fashion-mnist", Path("/usr/share/datasets/fashion-mnist")]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _write_idx(path: Path, array: np.ndarray) -> None:
    magic = 0x0803 if array.ndim == 3 else 0x0801
    path.write_bytes(struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes())


def _fashion_slice(tmp_path_factory, n_train: int, n_test: int) -> str:
    src = next((d for d in FASHION_DIRS if d.is_dir()), None)
    if src is None:
        pytest.skip("no Fashion-MNIST IDX files in data/fashion-mnist or /usr/share/datasets/fashion-mnist")
    out = tmp_path_factory.mktemp(f"fashion-{n_train}")
    for split, n in (("train", n_train), ("t10k", n_test)):
        x, y = load_idx_pair("fashion-mnist", src, split)
        _write_idx(out / f"{split}-images-idx3-ubyte", x[:n, 0])
        _write_idx(out / f"{split}-labels-idx1-ubyte", y[:n])
    return str(out)


@pytest.fixture(scope="module")
def small_fashion(tmp_path_factory) -> str:
    """The first 512 training and 100 test images of Fashion-MNIST, as IDX files: the recipes'
    data at a size a 2-core CPU trains in seconds (a bf16 forward pass over 500 test images, at the
    start and the end of the run, cost as much as a training step of 512)."""
    return _fashion_slice(tmp_path_factory, 512, 100)


@pytest.fixture(scope="module")
def tiny_fashion(tmp_path_factory) -> str:
    """The first 16 training and 100 test images: 2 steps an epoch at a 64th of the recipes'
    batch (the maths test below)."""
    return _fashion_slice(tmp_path_factory, 16, 100)


def test_the_fashion_recipes_are_there():
    assert {p.name for p in RECIPES} >= {"fashion-93.yaml", "fashion-94.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_a_recipe_is_valid_config_with_a_header_saying_what_it_aims_at(path):
    cfg = TrainConfig.from_dict(load_yaml(str(path)), source=str(path))
    validate(cfg)
    header = path.read_text().split("\n\n")[0]
    assert header.startswith("#") and "aims at" in header and "Measured" in path.read_text()


@pytest.mark.parametrize("name,epochs,augment,bench", [("fashion-93", 7, "flip", "fast5-flip"),
                                                      ("fashion-94", 25, "flip,translate:2", "long")])
def test_the_fashion_recipes_are_the_benchmarks(name, epochs, augment, bench):
    """The benchmark's maths, with --compile default (a faster step, the same maths to bf16
    tolerance: tests/step/test_fast.py) buying the epochs that reach the targets (fast5-flip had 5)."""
    import fashion_tta as b
    cfg = TrainConfig.from_dict(load_yaml(str(ROOT / "recipes" / f"{name}.yaml")))
    assert (cfg.model, cfg.dataset, cfg.workers, cfg.batch_size, cfg.lr, cfg.optimizer, cfg.momentum,
            cfg.weight_decay, cfg.label_smoothing, cfg.lr_schedule, cfg.warmup_fraction) == (
        "fashion-net", "fashion-mnist", 1, b.BATCH, b.LR, "nesterov", b.MOMENTUM, b.WD, b.SMOOTHING, "linear",
        b.WARMUP)
    assert (cfg.epochs, cfg.augment, cfg.precision, cfg.channels_last, cfg.compile) == (
        epochs, augment, "bf16", True, "default")
    assert b.RECIPES[bench]["augment"] == augment


def test_the_recipe_runs_from_the_cli_with_a_budget_override(small_fashion, tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    # The batch overridden too: a bf16 step costs in proportion to its batch on this CPU (one step
    # of the recipe's 512 was ~35 s); the recipe's other fields show it was read. The CLI's main()
    # in this process, in the checkout (tests/cli_inproc.py): what it trains is the point, not the
    # program's process (a fresh interpreter was ~3 s of two cores).
    from cli_inproc import run_main
    monkeypatch.chdir(ROOT)
    r = run_main(["train", "--config", "recipes/fashion-94.yaml", "--data-dir", small_fashion,
                  "--device", "cpu", "--samples", "64", "--batch-size", "64", "--compile", "off", "--no-progress",
                  "--out", str(out)], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert (s["status"], s["steps"], s["model"], s["batch_size"]) == ("completed", 1, "fashion-net", 64)
    assert (s["optimizer"], s["lr"], s["precision"], s["channels_last"], s["augment"]) == (
        "nesterov", 0.2, "bf16", True, "flip,translate:2")
    assert 0 <= s["test_accuracy"] <= 1 and s["wall_time_s"] > 0


def test_a_bad_override_of_a_recipe_is_exit_2_and_one_line(tmp_path, capfd, monkeypatch):
    """The CLI's main() in this process, in the checkout (a fresh interpreter was ~3 s of two
    cores here), fd 2 read."""
    from shmlearn.cli.main import main
    monkeypatch.chdir(ROOT)
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    try:
        code = main(["train", "--config", "recipes/fashion-93.yaml", "--label-smoothing", "1.5",
                     "--out", str(tmp_path / "run")])
    except SystemExit as e:
        code = e.code
    r = subprocess.CompletedProcess([], code, *capfd.readouterr())
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "shmlearn: error: --label-smoothing 1.5: expected a finite number >= 0 and < 1"]


@pytest.mark.parametrize("recipe", ["fashion-93", "fashion-94"])
def test_the_recipe_through_shmlearn_train_is_the_benchmarks_maths(recipe, tiny_fashion, tmp_path, monkeypatch):
    """3 epochs of 16 images = 6 steps of 8 (warmup 1), seed 3, on the CPU in the recipe's
    bf16 and channels_last: the same losses, step for step, and the same test accuracy. Both
    sides take a 64th of the recipes' batch of 512 (the batch is the same config field on
    both; tests above check its value): a bf16 step is slow on a CPU without bf16 units (torch's
    reference convolution, its time in proportion to the batch: 4.7 s a step of 32 here, 1.0 s
    of 8), and 6 steps of 512 on each side were the suite's largest cost (6 of 128, as a quarter,
    still its largest; 6 of 32 took ~24 s a recipe)."""
    import fashion_tta as b
    from shmlearn.data import load_dataset
    from shmlearn.step.fast import StepOptions, Stepper

    cfg = TrainConfig.from_dict({**load_yaml(str(ROOT / "recipes" / f"{recipe}.yaml")), "epochs": 3,
                                 "compile": "off"})  # the maths; compiled kernels: tests/step/test_fast.py
    augment = cfg.augment
    assert cfg.batch_size == b.BATCH
    monkeypatch.setattr(b, "BATCH", b.BATCH // 64)
    cfg = TrainConfig(**{**cfg.to_dict(), "batch_size": b.BATCH, "data_dir": tiny_fashion, "device": "cpu",
                         "threads": 1, "seed": 3, "log_every": 1, "progress": False, "out": str(tmp_path / "run")})
    torch.set_num_threads(1)
    result = shmlearn.train(cfg)
    ours = [json.loads(line)["loss"] for line in open(tmp_path / "run" / "metrics.jsonl")]

    seen = []
    read = Stepper.read
    monkeypatch.setattr(Stepper, "read", lambda self, *a, **k: seen.append(read(self, *a, **k)) or seen[-1])
    data = load_dataset("fashion-mnist", tiny_fashion)
    opts = StepOptions(precision=cfg.precision, channels_last=cfg.channels_last, cuda_graph="off", check_every=1)
    row = b._train_one(data, torch.device("cpu"), 0, 1, 3, 3, opts, lambda: None, lambda t: t, augment)
    theirs = [loss for win in seen for loss in win.losses]

    assert row["steps"] == result.summary["steps"] == len(ours) == len(theirs) == 6
    assert ours == theirs
    assert result.summary["test_accuracy"] == row["test_accuracy"]


def test_a_flag_replaces_its_pair_from_the_config_file():
    from shmlearn.cli.main import build_parser, config_from_args
    path = "recipes/fashion-93.yaml"
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(ROOT / path), "--samples", "1024",
                                                      "--warmup", "3"]))
    assert (cfg.samples, cfg.epochs, cfg.warmup, cfg.warmup_fraction) == (1024, None, 3, None)
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(ROOT / path), "--lr", "0.1"]))
    assert (cfg.samples, cfg.epochs, cfg.warmup, cfg.warmup_fraction, cfg.lr) == (None, 7, 0, 0.2, 0.1)
