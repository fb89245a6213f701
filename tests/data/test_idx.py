"""IDX reader against bytes written by hand in the official layout (header built with struct,
independently of the reader), and the MNIST-family loader on those files."""
import gzip
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from shmlearn.data import load_dataset
from shmlearn.data.idx import FASHION_MNIST_DIR, parse_idx, read_idx
from shmlearn.errors import BadInput


def idx_images(images: np.ndarray) -> bytes:
    n, rows, cols = images.shape
    return struct.pack(">IIII", 0x00000803, n, rows, cols) + images.astype(np.uint8).tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    return struct.pack(">II", 0x00000801, len(labels)) + labels.astype(np.uint8).tobytes()


def write(path: Path, raw: bytes, gz: bool = False) -> Path:
    if gz:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)
    return path


def make_mnist_dir(folder: Path, n_train=6, n_test=4, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {"train": (rng.integers(0, 256, (n_train, 28, 28)), rng.integers(0, 10, n_train)),
              "t10k": (rng.integers(0, 256, (n_test, 28, 28)), rng.integers(0, 10, n_test))}
    for split, (x, y) in arrays.items():
        write(folder / f"{split}-images-idx3-ubyte", idx_images(x), gz)
        write(folder / f"{split}-labels-idx1-ubyte", idx_labels(y), gz)
    return arrays


def test_parse_known_bytes():
    # 2 images of 2x3, written out byte by byte: magic 00 00 08 03, dims 2, 2, 3, then values.
    raw = bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 3] + list(range(12)))
    x = parse_idx(raw, "mem")
    assert x.dtype == np.uint8 and x.shape == (2, 2, 3)
    assert x.tolist() == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]
    assert x.flags.writeable


def test_parse_big_endian_int32_and_float():
    raw = bytes([0, 0, 0x0C, 1, 0, 0, 0, 2]) + struct.pack(">ii", -2, 70000)
    assert parse_idx(raw, "mem").tolist() == [-2, 70000]
    raw = bytes([0, 0, 0x0D, 1, 0, 0, 0, 1]) + struct.pack(">f", 1.5)
    assert parse_idx(raw, "mem").tolist() == [1.5]


@pytest.mark.parametrize("gz", [False, True])
def test_read_file(tmp_path, gz):
    x = np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256
    path = write(tmp_path / "train-images-idx3-ubyte", idx_images(x), gz)
    np.testing.assert_array_equal(read_idx(path, magic=0x00000803), x)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_loader(tmp_path, gz):
    arrays = make_mnist_dir(tmp_path, gz=gz)
    ds = load_dataset("mnist", str(tmp_path))
    assert ds.spec.input_shape == (1, 28, 28) and ds.spec.num_outputs == 10
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    np.testing.assert_array_equal(ds.train_x.numpy()[:, 0], arrays["train"][0])
    np.testing.assert_array_equal(ds.train_y.numpy(), arrays["train"][1])
    np.testing.assert_array_equal(ds.test_x.numpy()[:, 0], arrays["t10k"][0])
    np.testing.assert_array_equal(ds.test_y.numpy(), arrays["t10k"][1])
    train = arrays["train"][0].astype(np.float64)
    assert ds.mean[0] == pytest.approx(train.mean()) and ds.std[0] == pytest.approx(train.std())


def test_truncated_message(tmp_path):
    make_mnist_dir(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(struct.pack(">IIII", 0x803, 60000, 28, 28) + bytes(984))
    with pytest.raises(BadInput, match=r"train-images-idx3-ubyte: truncated: header says 60000 "
                                       r"items of 28x28 uint8 = 47040016 bytes .* file has 1000"):
        load_dataset("mnist", str(tmp_path))


@pytest.mark.parametrize("name, raw, match", [
    ("train-images-idx3-ubyte", struct.pack(">IIII", 0x801, 6, 28, 28), "wrong magic 0x00000801, expected 0x00000803"),
    ("train-labels-idx1-ubyte", b"\x00\x00", "shorter than the 4-byte magic"),
    ("train-labels-idx1-ubyte", struct.pack(">I", 0x801), "truncated: 1 dims need a 8-byte header"),
    ("train-labels-idx1-ubyte", idx_labels(np.zeros(5)), "5 labels for the 6 images"),
    ("train-labels-idx1-ubyte", idx_labels(np.array([0, 1, 2, 10, 3, 4])), "label 10 out of range: expected 0..9"),
    ("train-labels-idx1-ubyte", idx_labels(np.zeros(6)) + b"x", "trailing bytes"),
    ("t10k-images-idx3-ubyte", idx_images(np.zeros((4, 32, 32))), "images are 32x32, mnist expects 28x28"),
])
def test_bad_files(tmp_path, name, raw, match):
    make_mnist_dir(tmp_path)
    (tmp_path / name).write_bytes(raw)
    with pytest.raises(BadInput, match=match) as e:
        load_dataset("mnist", str(tmp_path))
    assert name in str(e.value) and "\n" not in str(e.value)


def test_corrupt_gzip(tmp_path):
    make_mnist_dir(tmp_path, gz=True)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-12])  # cut off: EOFError inside gzip
    with pytest.raises(BadInput, match=r"train-labels-idx1-ubyte.gz: corrupt gzip"):
        load_dataset("mnist", str(tmp_path))
    path.write_bytes(b"not gzip at all")  # BadGzipFile inside gzip
    with pytest.raises(BadInput, match=r"train-labels-idx1-ubyte.gz: corrupt gzip"):
        load_dataset("mnist", str(tmp_path))


def test_missing_file_and_dir(tmp_path):
    make_mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(BadInput, match=r"fashion-mnist: no t10k-labels-idx1-ubyte\[.gz\] in "):
        load_dataset("fashion-mnist", str(tmp_path))
    with pytest.raises(BadInput, match=r"--data-dir .*nowhere: no such directory"):
        load_dataset("mnist", str(tmp_path / "nowhere"))
    with pytest.raises(BadInput, match=r"--data-dir: mnist needs a --data-dir"):
        load_dataset("mnist")


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(), reason=f"{FASHION_MNIST_DIR} not installed")
def test_installed_fashion_mnist():
    ds = load_dataset("fashion-mnist")
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert int(ds.train_y.min()) == 0 and int(ds.train_y.max()) == 9
    assert ds.train_y.bincount().tolist() == [6000] * 10  # Fashion-MNIST is balanced
    assert ds.mean[0] == pytest.approx(0.2860 * 255, abs=0.1)
    assert ds.std[0] == pytest.approx(0.3530 * 255, abs=0.1)


def write_split(folder: Path, split: str, x: np.ndarray) -> None:
    write(folder / f"{split}-images-idx3-ubyte", idx_images(x))
    write(folder / f"{split}-labels-idx1-ubyte", idx_labels(np.zeros(len(x))))


@pytest.mark.parametrize("split, x, match", [
    ("t10k", np.zeros((0, 28, 28)), "the test set has 0 images; evaluation needs at least 1"),
    ("train", np.zeros((0, 28, 28)), "the train set has 0 images; nothing to learn"),
    ("train", np.zeros((6, 28, 28)),
     r"every training image has the same value 0 \(standard deviation 0\); nothing to learn"),
    ("train", np.full((6, 28, 28), 255),
     r"every training image has the same value 255 \(standard deviation 0\); nothing to learn"),
], ids=["empty-test", "empty-train", "all-0", "all-255"])
def test_unusable_data_is_bad_input(tmp_path, split, x, match):
    # Before: an empty test set loaded (ZeroDivisionError in evaluation), an empty train set and
    # constant images loaded with std NaN or 0 (NaN inputs, reported as divergence).
    make_mnist_dir(tmp_path)
    write_split(tmp_path, split, x)
    with pytest.raises(BadInput, match=f"^--data-dir {tmp_path}: {match}$") as e:
        load_dataset("mnist", str(tmp_path))
    assert "\n" not in str(e.value)


def test_constant_test_images_are_fine(tmp_path):
    # Only the train set's statistics normalize; a blank test image is odd but not NaN.
    make_mnist_dir(tmp_path)
    write_split(tmp_path, "t10k", np.zeros((4, 28, 28)))
    assert len(load_dataset("mnist", str(tmp_path)).test_x) == 4


@pytest.mark.parametrize("x, split", [(np.zeros((64, 28, 28)), "train"),
                                      (np.zeros((0, 28, 28)), "t10k")], ids=["all-0", "empty-test"])
def test_cli_exits_2_with_one_line(tmp_path, capfd, monkeypatch, x, split):
    """The CLI's main() in this process (its one worker runs here; a fresh interpreter was ~3 s of
    two cores), fd 2 read."""
    from shmlearn.cli.main import main
    data = tmp_path / "data"
    data.mkdir()
    make_mnist_dir(data, n_train=64)  # two batches of 32, so only the data itself is wrong
    write_split(data, split, x)
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    capfd.readouterr()
    try:
        code = main(["train", "--dataset", "fashion-mnist", "--data-dir", str(data), "--model", "lenet",
                     "--workers", "1", "--epochs", "1", "--out", str(tmp_path / "run")])
    except SystemExit as e:
        code = e.code
    r = subprocess.CompletedProcess([], code, *capfd.readouterr())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].endswith(f"--data-dir {data}: " + ("every training image has the same value 0"
                                                       " (standard deviation 0); nothing to learn"
                                                       if split == "train" else
                                                       "the test set has 0 images; evaluation"
                                                       " needs at least 1")), r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
