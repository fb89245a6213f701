"""CIFAR-10 reader on small batches written in both official formats: pickled dicts with bytes
keys (protocol 2, as the Python 2 originals), and the .bin records of 1 label + 3072 bytes."""
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from shmlearn.data import load_dataset
from shmlearn.errors import BadInput

BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def make_arrays(n=3, seed=0):
    """{batch name: (data (n, 3072) uint8, labels list)}; the labels differ per batch."""
    rng = np.random.default_rng(seed)
    return {name: (rng.integers(0, 256, (n, 3072), dtype=np.uint8), [(i + j) % 10 for j in range(n)])
            for i, name in enumerate(BATCHES)}


def pickle_batch(data, labels, numpy_module=b"numpy._core.multiarray", **extra) -> bytes:
    batch = {b"batch_label": b"training batch 1 of 5", b"labels": labels, b"data": data,
             b"filenames": [b"x.png"] * len(labels), **extra}
    raw = pickle.dumps(batch, protocol=2)
    # The originals were pickled by Python 2 numpy, which names numpy.core.multiarray.
    return raw.replace(b"numpy._core.multiarray", numpy_module)


def write_py(folder: Path, arrays, **kw) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, labels) in arrays.items():
        (folder / name).write_bytes(pickle_batch(data, labels, **kw))
    return folder


def write_bin(folder: Path, arrays) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, labels) in arrays.items():
        records = np.concatenate([np.array(labels, np.uint8)[:, None], data], axis=1)
        (folder / f"{name}.bin").write_bytes(records.tobytes())
    return folder


def check(ds, arrays):
    train = [arrays[name] for name in BATCHES[:5]]
    assert ds.train_x.shape == (15, 3, 32, 32) and ds.train_x.dtype == torch.uint8
    assert ds.train_y.tolist() == sum((labels for _, labels in train), [])
    assert ds.test_y.tolist() == arrays["test_batch"][1]
    first = arrays["data_batch_1"][0][0]
    # Row layout: 1024 red bytes (row-major 32x32), then green, then blue.
    assert ds.train_x[0, 0, 0, 1] == first[1] and ds.train_x[0, 0, 1, 0] == first[32]
    assert ds.train_x[0, 1, 0, 0] == first[1024] and ds.train_x[0, 2, 31, 31] == first[3071]
    np.testing.assert_array_equal(ds.test_x.numpy().reshape(3, -1), arrays["test_batch"][0])
    all_train = np.concatenate([d for d, _ in train]).reshape(15, 3, -1).astype(np.float64)
    assert ds.mean == pytest.approx(tuple(all_train.mean((0, 2))))
    assert ds.std == pytest.approx(tuple(all_train.std((0, 2))))
    assert ds.spec.input_shape == (3, 32, 32) and ds.spec.num_outputs == 10


@pytest.mark.parametrize("numpy_module", [b"numpy._core.multiarray", b"numpy.core.multiarray"])
def test_pickle_batches(tmp_path, numpy_module):
    arrays = make_arrays()
    write_py(tmp_path / "cifar-10-batches-py", arrays, numpy_module=numpy_module)
    check(load_dataset("cifar10", str(tmp_path)), arrays)  # the parent folder
    check(load_dataset("cifar10", str(tmp_path / "cifar-10-batches-py")), arrays)  # the folder


def test_bin_batches(tmp_path):
    arrays = make_arrays(seed=1)
    write_bin(tmp_path / "cifar-10-batches-bin", arrays)
    check(load_dataset("cifar10", str(tmp_path)), arrays)
    check(load_dataset("cifar10", str(tmp_path / "cifar-10-batches-bin")), arrays)


def load_error(tmp_path, match):
    with pytest.raises(BadInput, match=match) as e:
        load_dataset("cifar10", str(tmp_path))
    assert "\n" not in str(e.value)
    return str(e.value)


class _RunsCode:
    def __reduce__(self):
        return (os.getcwd, ())


@pytest.mark.parametrize("raw, match", [
    (pickle_batch(np.zeros((3, 3072), np.uint8), [0, 1, 2])[:-30], "cannot unpickle"),
    (b"garbage", "cannot unpickle"),
    (pickle.dumps([1, 2], protocol=2), "holds a list, not a dict"),
    (pickle.dumps({b"data": np.zeros((3, 3072), np.uint8)}, protocol=2), "no 'labels' key"),
    (pickle_batch(np.zeros((3, 3071), np.uint8), [0, 1, 2]), r"'data' is uint8 \(3, 3071\), expected uint8 \(N, 3072\)"),
    (pickle_batch(np.zeros((3, 3072), np.float32), [0, 1, 2]), r"'data' is float32"),
    (pickle_batch(np.zeros((3, 3072), np.uint8), [0, 1]), "2 labels for 3 images"),
    (pickle_batch(np.zeros((3, 3072), np.uint8), [0, 1, 12]), r"label 12 out of range: expected 0..9"),
    (pickle_batch(np.zeros((3, 3072), np.uint8), [0, 1, "x"]), "'labels' is not a list of integers"),
    (pickle.dumps({b"data": _RunsCode(), b"labels": []}, protocol=2), "refusing to load"),
])
def test_bad_pickle(tmp_path, raw, match):
    write_py(tmp_path, make_arrays())
    (tmp_path / "data_batch_3").write_bytes(raw)
    assert "data_batch_3" in load_error(tmp_path, match)


def test_bad_bin(tmp_path):
    write_bin(tmp_path, make_arrays())
    path = tmp_path / "test_batch.bin"
    path.write_bytes(path.read_bytes()[:-1])
    load_error(tmp_path, r"test_batch.bin: 9218 bytes is not a positive multiple of the 3073-byte")
    path.write_bytes(bytes([10]) + bytes(3072))
    load_error(tmp_path, r"test_batch.bin: label 10 out of range")


def test_missing(tmp_path):
    load_error(tmp_path, r"cifar10: no data_batch_1 or data_batch_1.bin in ")
    write_py(tmp_path, make_arrays())
    (tmp_path / "data_batch_4").unlink()
    load_error(tmp_path, r"cifar10: no data_batch_4 in .* \(expected data_batch_1..5 and test_batch\)")
    with pytest.raises(BadInput, match=r"--data-dir .*nope: no such directory"):
        load_dataset("cifar10", str(tmp_path / "nope"))
    with pytest.raises(BadInput, match=r"--data-dir: cifar10 needs a --data-dir"):
        load_dataset("cifar10")
