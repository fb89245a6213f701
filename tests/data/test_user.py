"""data/user.py: the user's arrays or torch Datasets become a Dataset (or StreamedData), values
as given, the task read from the labels unless stated; every bad input is one BadInput line
naming the argument."""
import numpy as np
import pytest
import torch

from shmlearn.data import normalizer
from shmlearn.data.stream import StreamedData
from shmlearn.data.user import user_data
from shmlearn.errors import BadInput

CPU = torch.device("cpu")


class Pairs(torch.utils.data.Dataset):
    """A map-style Dataset over arrays, items as numpy values (x, y)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _arrays(n_train=40, n_test=12, features=3, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n_train, features)) * 50 + 1000, rng.normal(size=(n_test, features)) * 50 + 1000)


def _one_line(e) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


# --- the task, from the labels -----------------------------------------------------------------

def test_integer_labels_are_classification_with_k_the_largest_label_plus_one():
    trx, tex = _arrays()
    tr_y = np.arange(40) % 4              # 0..3 in train
    te_y = np.array([0, 1, 6] * 4)        # 6 only in test: K counts it, or evaluation would index past the logits
    ds = user_data((trx, tr_y, tex, te_y), "data=")
    assert (ds.spec.task, ds.spec.num_outputs, ds.spec.input_shape) == ("classification", 7, (3,))
    assert ds.train_y.dtype == ds.test_y.dtype == torch.int64
    assert ds.train_y.shape == (40,) and torch.equal(ds.train_y, torch.as_tensor(tr_y))
    ds = user_data((trx, np.arange(40) % 9, tex, te_y % 2), "data=")  # and the train labels' largest
    assert ds.spec.num_outputs == 9


def test_integer_zero_one_labels_are_two_classes_not_binary():
    trx, tex = _arrays()
    ds = user_data((trx, np.arange(40) % 2, tex, np.arange(12) % 2), "data=")
    assert (ds.spec.task, ds.spec.num_outputs) == ("classification", 2)


def test_float_labels_are_regression_with_n_by_1_targets():
    trx, tex = _arrays()
    tr_y, te_y = np.linspace(-3, 3, 40), np.linspace(0, 1, 12)
    ds = user_data((trx, tr_y, tex, te_y), "data=")
    assert (ds.spec.task, ds.spec.num_outputs) == ("regression", 1)
    assert ds.train_y.shape == (40, 1) and ds.test_y.shape == (12, 1) and ds.train_y.dtype == torch.float32
    assert torch.equal(ds.train_y[:, 0], torch.as_tensor(tr_y, dtype=torch.float32))
    # several targets per sample stay (N, outputs)
    ds = user_data((trx, np.ones((40, 2)) * tr_y[:, None], tex, np.zeros((12, 2))), "data=")
    assert (ds.spec.task, ds.spec.num_outputs, ds.train_y.shape) == ("regression", 2, (40, 2))


def test_binary_only_when_stated():
    trx, tex = _arrays()
    tr_y, te_y = (np.arange(40) % 2).astype(np.float32), (np.arange(12) % 2).astype(np.float32)
    assert user_data((trx, tr_y, tex, te_y), "data=").spec.task == "regression"
    ds = user_data((trx, tr_y, tex, te_y), "data=", task="binary")
    assert (ds.spec.task, ds.spec.num_outputs, ds.train_y.shape, ds.train_y.dtype) == \
        ("binary", 1, (40, 1), torch.float32)
    ds = user_data((trx, np.arange(40) % 2, tex, np.arange(12) % 2), "data=", task="binary")  # int 0/1 too
    assert (ds.spec.task, ds.train_y.dtype) == ("binary", torch.float32)


def test_whole_float_labels_are_classes_when_stated():
    trx, tex = _arrays()
    ds = user_data((trx, (np.arange(40) % 3).astype(np.float64), tex, np.zeros(12) + 2.0), "data=",
                   task="classification")
    assert (ds.spec.task, ds.spec.num_outputs, ds.train_y.dtype) == ("classification", 3, torch.int64)


# --- values as given ---------------------------------------------------------------------------

def test_feature_values_are_used_as_given():
    trx, tex = _arrays()  # mean ~1000, std ~50: a normalizing reader would change them
    ds = user_data((trx, np.arange(40) % 2, tex, np.arange(12) % 2), "data=")
    assert ds.mean is None and ds.std is None
    assert ds.train_x.dtype == torch.float32
    assert torch.equal(ds.train_x, torch.as_tensor(trx, dtype=torch.float32))
    assert torch.equal(ds.test_x, torch.as_tensor(tex, dtype=torch.float32))
    # and the model sees them so: the run's normalizer is the identity
    assert torch.equal(normalizer(ds, CPU)(ds.train_x), ds.train_x)


def test_uint8_images_stay_uint8_and_are_not_rescaled():
    rng = np.random.default_rng(1)
    trx = rng.integers(0, 256, size=(20, 1, 4, 4), dtype=np.uint8)
    tex = rng.integers(0, 256, size=(6, 1, 4, 4), dtype=np.uint8)
    ds = user_data((torch.as_tensor(trx), torch.arange(20) % 3, torch.as_tensor(tex), torch.arange(6) % 3), "data=")
    assert ds.train_x.dtype == torch.uint8 and ds.spec.input_shape == (1, 4, 4) and ds.spec.is_image
    batch = normalizer(ds, CPU)(ds.train_x)
    assert batch.dtype == torch.float32 and torch.equal(batch, torch.as_tensor(trx).float())  # 0..255, not 0..1


def test_tensors_and_a_callable_work_as_arrays_do():
    trx, tex = _arrays()
    arrays = (trx, np.arange(40) % 2, tex, np.arange(12) % 2)
    want = user_data(arrays, "data=")
    got = user_data(lambda: tuple(torch.as_tensor(a) for a in arrays), "data=")
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.spec == want.spec


def test_a_dataset_pair_read_whole_matches_the_same_arrays():
    trx, tex = _arrays()
    tr_y, te_y = np.arange(40) % 5, np.arange(12) % 5
    want = user_data((trx, tr_y, tex, te_y), "data=")
    got = user_data((Pairs(trx, tr_y), Pairs(tex, te_y)), "data=", loader="resident")
    assert not isinstance(got, StreamedData) and got.spec == want.spec
    for name in ("train_x", "train_y", "test_x", "test_y"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    streamed = user_data((Pairs(trx, tr_y), Pairs(tex, te_y)), "data=", loader="stream")
    assert isinstance(streamed, StreamedData) and streamed.spec == want.spec
    assert streamed.mean is None and (streamed.n_train, streamed.n_test) == (40, 12)


def test_auto_streams_only_what_does_not_fit(monkeypatch):
    import shmlearn.data.user as user
    trx, tex = _arrays()
    pair = (Pairs(trx, np.arange(40) % 2), Pairs(tex, np.arange(12) % 2))
    assert not isinstance(user_data(pair, "data="), StreamedData)
    monkeypatch.setattr(user, "_free_bytes", lambda device: 1000)  # 52 samples x 32 bytes > half of it
    assert isinstance(user_data(pair, "data="), StreamedData)


# --- bad input: one line naming the argument -----------------------------------------------------

def _bad(obj, *, what="data=", **kw) -> str:
    with pytest.raises(BadInput) as e:
        user_data(obj, what, **kw)
    msg = _one_line(e)
    assert msg.startswith(what + ": ") or msg.startswith("--task"), msg
    return msg


def test_mismatched_lengths():
    trx, tex = _arrays()
    assert _bad((trx, np.arange(39) % 2, tex, np.arange(12) % 2)).endswith(
        "train_x has 40 samples but train_y has 39")
    assert _bad((trx, np.arange(40) % 2, tex, np.arange(13) % 2)).endswith(
        "test_x has 12 samples but test_y has 13")


def test_mismatched_dtypes():
    trx, tex = _arrays()
    msg = _bad((trx, np.arange(40) % 2, tex, (np.arange(12) % 2).astype(np.float32)))
    assert "train_y is int64 but test_y is float32" in msg
    msg = _bad((trx, np.arange(40) % 2, tex.astype(np.float32), np.arange(12) % 2))
    assert "train_x is float64 but test_x is float32" in msg


def test_mismatched_sample_shapes():
    trx, _ = _arrays()
    msg = _bad((trx, np.arange(40) % 2, np.zeros((12, 4)), np.arange(12) % 2))
    assert "train_x samples have shape (3,) but test_x samples (4,)" in msg
    assert "at least 2 dimensions" in _bad((np.zeros(40), np.arange(40) % 2, np.zeros(12), np.arange(12) % 2))


def test_negative_labels():
    trx, tex = _arrays()
    assert _bad((trx, np.arange(40) % 3 - 1, tex, np.arange(12) % 2)).endswith(
        "train_y holds label -1 at row 0; class labels must be 0..K-1")
    assert "test_y holds label -2" in _bad((trx, np.arange(40) % 3, tex, -2 * (np.arange(12) % 2)))


def test_non_integer_labels_for_classification():
    trx, tex = _arrays()
    msg = _bad((trx, np.linspace(0, 2, 40), tex, np.zeros(12)), task="classification")
    assert "train_y holds non-integer labels" in msg
    msg = _bad((trx, np.zeros(40) + 1, tex, np.array([np.nan] * 12)), task="classification")
    assert "test_y holds non-integer labels" in msg


@pytest.mark.parametrize("labels,words", [
    ((np.zeros(40, dtype=np.int64), np.zeros(12, dtype=np.int64)), "every label is 0"),
    ((np.zeros((40, 2), dtype=np.int64), np.zeros((12, 2), dtype=np.int64)), "class labels are one integer"),
    ((np.full(40, 2.0), np.zeros(12)), "binary targets are 0 or 1"),
    ((np.array([np.inf] + [0.0] * 39), np.zeros(12)), "NaN or infinite targets"),
])
def test_other_labels_that_cannot_train(labels, words):
    trx, tex = _arrays()
    task = "binary" if "binary" in words else None
    assert words in _bad((trx, labels[0], tex, labels[1]), task=task)


@pytest.mark.parametrize("obj,words", [
    ((np.zeros((4, 2)),) * 3, "got a tuple of 3"),
    ({"x": 1}, "got a dict"),
    ((np.zeros((40, 3)), ["a"] * 40, np.zeros((12, 3)), np.zeros(12)), "train_y is not a numeric array"),
    ((np.zeros((40, 3), dtype=np.complex64), np.zeros(40), np.zeros((12, 3), dtype=np.complex64), np.zeros(12)),
     "train_x has dtype torch.complex64"),
])
def test_what_is_not_data_is_refused(obj, words):
    assert words in _bad(obj)


def test_a_callable_that_raises_names_the_flag():
    def load():
        raise OSError("no such file: /data/x.npz")
    msg = _bad(load, what="--dataset own.py:load")
    assert msg == "--dataset own.py:load: test_a_callable_that_raises_names_the_flag.<locals>.load() raised " \
                  "OSError: no such file: /data/x.npz"


def test_bad_datasets():
    trx, tex = _arrays()
    good = Pairs(tex, np.arange(12) % 2)
    assert "the train Dataset is empty" in _bad((Pairs(trx[:0], np.zeros(0)), good))
    assert "train Dataset's items must be (x, y) pairs; item 0 is a ndarray" in _bad((torch.utils.data.Subset(
        _Items(trx), range(40)), good))
    assert "holds label -1" in _bad((Pairs(trx, np.arange(40) % 2 - 1), good), loader="resident")


class _Items(torch.utils.data.Dataset):
    def __init__(self, x):
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def test_stream_needs_datasets_and_task_and_loader_values_are_checked():
    trx, tex = _arrays()
    arrays = (trx, np.arange(40) % 2, tex, np.arange(12) % 2)
    assert "--loader stream needs a pair of torch Datasets" in _bad(arrays, loader="stream")
    with pytest.raises(BadInput) as e:
        user_data(arrays, "data=", task="ranking")
    assert _one_line(e).startswith("--task ranking: choose one of classification, binary, regression")


@pytest.mark.parametrize("where,value,says", [
    ("train_x", np.nan, "train_x holds nan at row 7, column 2; every input must be a finite number"),
    ("train_x", np.inf, "train_x holds inf at row 7, column 2"),
    ("test_x", np.nan, "test_x holds nan at row 7, column 2"),
])
def test_a_non_finite_input_is_named_by_array_row_and_column(where, value, says):
    """Issue 38, 10: one NaN feature was reported as a divergence 'at step 12 on rank 1', an inf
    column at step 0, all-NaN features as 'standard deviation 0', a NaN in the test set as rc 0
    with test_loss NaN. Each is named before training."""
    trx, tex = _arrays()
    arrays = {"train_x": trx.copy(), "test_x": tex.copy()}
    arrays[where][7, 2] = value
    msg = _bad((arrays["train_x"], np.arange(40) % 2, arrays["test_x"], np.arange(12) % 2))
    assert says in msg, msg
    trx = np.full_like(trx, np.nan)
    assert "train_x holds nan at row 0, column 0 (" in _bad((trx, np.arange(40) % 2, tex, np.arange(12) % 2))


def test_a_huge_label_is_named_before_the_model_is_sized_by_it():
    """Issue 38, 10: a label of 10^9 made a 10^9-wide output layer (512 GB, 21 s, then a crash)."""
    trx, tex = _arrays()
    y = np.arange(40) % 2
    y[5] = 10 ** 9
    msg = _bad((trx, y, tex, np.arange(12) % 2))
    assert "train_y holds label 1000000000 at row 5; class labels must be 0..K-1 with K at most 1048576" in msg, msg
