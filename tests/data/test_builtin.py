"""Built-in datasets and the registry: shapes, dtypes, determinism, and the rules they encode."""
import numpy as np
import pytest
import torch

from shmlearn.data import DATASETS, Dataset, DataSpec, load_dataset, normalizer
from shmlearn.data.base import check_usable
from shmlearn.data.builtin import line, step, synthetic
from shmlearn.errors import BadInput


def test_registry_names_and_unknown():
    assert {"digits", "fashion-mnist", "mnist", "cifar10", "tiny-imagenet",
            "synthetic", "step", "line"} <= set(DATASETS)
    with pytest.raises(BadInput, match=r"^--dataset foo: unknown dataset; choose one of digits, "):
        load_dataset("foo")


def test_digits_split():
    ds = load_dataset("digits")
    assert ds.train_x.shape == (1437, 1, 8, 8) and ds.test_x.shape == (360, 1, 8, 8)
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    assert int(ds.train_x.max()) == 16 and ds.spec.num_outputs == 10
    # Stratified: each of the 10 digits has 35 or 37 test images (about 20% of ~180).
    assert set(ds.test_y.bincount().tolist()) <= {35, 36, 37}
    again = load_dataset("digits", seed=5)  # the split is fixed, not seeded
    assert torch.equal(ds.test_x, again.test_x)
    x = ds.train_x.numpy().astype(np.float64)
    assert ds.mean[0] == pytest.approx(x.mean()) and ds.std[0] == pytest.approx(x.std())


def test_digits_is_scikit_learns_split_without_importing_it():
    """The same images, labels and order as load_digits + train_test_split(test_size=0.2,
    stratify, random_state=0) give (the stored split against the installed scikit-learn), read
    without importing scikit-learn (about a second of every worker's start-up)."""
    import subprocess
    import sys
    code = ("import sys; from shmlearn.data import load_dataset; load_dataset('digits'); "
            "print(any(m == 'sklearn' or m.startswith('sklearn.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    bunch = load_digits()
    tx, vx, ty, vy = train_test_split(bunch.images.astype(np.uint8)[:, None], bunch.target, test_size=0.2,
                                      stratify=bunch.target, random_state=0)
    ds = load_dataset("digits")
    for ours, theirs in ((ds.train_x, tx), (ds.test_x, vx), (ds.train_y, ty), (ds.test_y, vy)):
        assert np.array_equal(ours.numpy(), theirs)


def test_synthetic_shapes_determinism_and_rule_is_learnable():
    ds = synthetic(seed=1, n_train=3000, n_test=500)
    assert ds.train_x.shape == (3000, 3, 32, 32) and ds.train_x.dtype == torch.uint8
    assert ds.test_y.shape == (500,) and ds.train_y.dtype == torch.int64
    assert torch.equal(ds.train_x, synthetic(seed=1, n_train=3000, n_test=500).train_x)
    assert not torch.equal(ds.train_y, synthetic(seed=2, n_train=3000, n_test=500).train_y)
    assert len(ds.train_y.unique()) == 10
    # A linear classifier on the 4x4 block means (what the rule reads) must beat chance (0.1)
    # by far on held-out images: the labels follow the pixels. LDA in closed form, so no
    # iterative training slows the test; it scores 0.80-0.87 over seeds 0-5.
    def features(x):
        return x.numpy().reshape(len(x), 3, 4, 8, 4, 8).mean((3, 5)).reshape(len(x), -1)
    x, y = features(ds.train_x), ds.train_y.numpy()
    means = np.stack([x[y == k].mean(0) for k in range(10)])
    w = np.linalg.solve(np.cov((x - means[y]).T), means.T)
    b = -0.5 * np.einsum("kf,fk->k", means, w) + np.log(np.bincount(y, minlength=10) / len(y))
    accuracy = ((features(ds.test_x) @ w + b).argmax(1) == ds.test_y.numpy()).mean()
    assert accuracy > 0.6


def test_synthetic_default_sizes():
    ds = load_dataset("synthetic", seed=0)
    assert len(ds.train_x) == 10000 and len(ds.test_x) == 2000
    assert ds.spec.input_shape == (3, 32, 32) and ds.spec.num_outputs == 10


def test_step_rule():
    ds = load_dataset("step", seed=3)
    assert ds.spec.task == "binary" and ds.spec.num_outputs == 1 and ds.mean is None
    assert ds.train_x.shape == (10000, 1) and ds.test_x.shape == (1000, 1)
    for x, y in ((ds.train_x, ds.train_y), (ds.test_x, ds.test_y)):
        assert x.dtype == torch.float32 and y.dtype == torch.float32 and y.shape == x.shape
        assert torch.equal(y, (x >= 0.5).float())
        assert 0 <= float(x.min()) and float(x.max()) < 1
    assert torch.equal(ds.train_x, step(seed=3).train_x)
    assert not torch.equal(ds.train_x, step(seed=4).train_x)


def test_line_rule():
    ds = load_dataset("line", seed=0)
    assert ds.spec.task == "regression" and ds.spec.input_shape == (1,) and ds.mean is None
    assert ds.train_x.shape == (1000, 1) and ds.test_y.shape == (200, 1)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.float32
    assert -1 <= float(ds.train_x.min()) and float(ds.train_x.max()) <= 1
    # Closed-form least squares recovers W = -1, b = 1; residuals have std 0.1.
    a = torch.cat([ds.train_x, torch.ones_like(ds.train_x)], 1).double()
    (w, b) = torch.linalg.lstsq(a, ds.train_y.double()).solution.flatten().tolist()
    assert w == pytest.approx(-1, abs=0.03) and b == pytest.approx(1, abs=0.02)
    residual = ds.train_y - (-ds.train_x + 1)
    assert float(residual.std()) == pytest.approx(0.1, rel=0.1)
    assert torch.equal(ds.test_y, line(seed=0).test_y)


@pytest.mark.parametrize("name", ["digits", "step"])
def test_normalizer(name):
    ds: Dataset = load_dataset(name)
    out = normalizer(ds, torch.device("cpu"))(ds.train_x)
    assert out.dtype == torch.float32
    if ds.mean is not None:  # train-set statistics normalize the train set to mean 0, std 1
        assert float(out.mean()) == pytest.approx(0, abs=1e-4)
        assert float(out.std()) == pytest.approx(1, abs=1e-3)


def _features(train_x: torch.Tensor, mean, std) -> Dataset:
    spec = DataSpec(name="f", task="regression", input_shape=(train_x.shape[1],), num_outputs=1)
    y = torch.zeros(len(train_x), 1)
    return Dataset(spec, train_x, y, train_x, y, mean, std)


def test_constant_feature_is_centred_not_divided_by_zero():
    # Feature 1 is constant (like digits' border pixels): normal data, and no NaN.
    x = torch.tensor([[0.0, 5.0], [2.0, 5.0]])
    ds = _features(x, (1.0, 5.0), (1.0, 0.0))
    check_usable(ds, "--dataset f")
    assert normalizer(ds, torch.device("cpu"))(x).tolist() == [[-1.0, 0.0], [1.0, 0.0]]


@pytest.mark.parametrize("mean, std", [((5.0, 5.0), (0.0, 0.0)), (None, None)])
def test_all_features_constant_is_bad_input(mean, std):
    ds = _features(torch.full((3, 2), 5.0), mean, std)
    with pytest.raises(BadInput, match=r"^--dataset f: every training sample has the same 2 "
                                       r"feature value\(s\) \(standard deviation 0\)"):
        check_usable(ds, "--dataset f")


def test_one_constant_image_channel_is_bad_input():
    # Per channel over the whole train set: std 0 means that channel is one value everywhere.
    x = torch.randint(0, 256, (4, 3, 2, 2), dtype=torch.uint8)
    x[:, 2] = 7
    spec = DataSpec(name="rgb", task="classification", input_shape=(3, 2, 2), num_outputs=10)
    y = torch.zeros(4, dtype=torch.int64)
    ds = Dataset(spec, x, y, x, y, (120.0, 130.0, 7.0), (70.0, 71.0, 0.0))
    with pytest.raises(BadInput, match=r"^--data-dir d: channel 2 of 3 holds one value \(7\) in "
                                       r"every training image \(standard deviation 0\)"):
        check_usable(ds, "--data-dir d")
