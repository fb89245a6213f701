"""The task losses against torch.nn.functional, and the two recipe options they need
(--label-smoothing, --warmup-fraction) validated once, one line naming the flag."""
import math

import pytest
import torch
import torch.nn.functional as F

from shmlearn.config.train_config import TrainConfig, validate
from shmlearn.errors import BadInput
from shmlearn.user.tasks import loss_fn


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.5, 0.99])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_label_smoothing_is_torchs(smoothing, reduction):
    torch.manual_seed(0)
    out, y = torch.randn(33, 10) * 3, torch.randint(0, 10, (33,))
    ref = F.cross_entropy(out, y, reduction=reduction, label_smoothing=smoothing)
    torch.testing.assert_close(loss_fn("classification", out, y, reduction, label_smoothing=smoothing), ref,
                               rtol=0, atol=0)
    # and what torch computes, written out: cross-entropy against (1 - s) one-hot + s / classes
    target = (1 - smoothing) * F.one_hot(y, 10) + smoothing / 10
    manual = -(target * out.log_softmax(1)).sum(1)
    torch.testing.assert_close(ref, manual.mean() if reduction == "mean" else manual.sum())


def test_label_smoothing_has_no_meaning_outside_classification():
    with pytest.raises(ValueError, match="classification"):
        loss_fn("regression", torch.zeros(3, 1), torch.zeros(3, 1), label_smoothing=0.1)


@pytest.mark.parametrize("kw,needle", [
    (dict(label_smoothing=1.0), "--label-smoothing 1.0: expected a finite number >= 0 and < 1"),
    (dict(label_smoothing=-0.1), "--label-smoothing -0.1:"),
    (dict(label_smoothing=math.nan), "--label-smoothing nan:"),
    (dict(label_smoothing="0.1"), "--label-smoothing '0.1' is a string; expected a number"),
    (dict(warmup_fraction=1.0), "--warmup-fraction 1.0: expected a finite number >= 0 and < 1"),
    (dict(warmup_fraction=-0.2), "--warmup-fraction -0.2:"),
    (dict(warmup=10, warmup_fraction=0.2), "--warmup 10 and --warmup-fraction 0.2: give one warmup"),
])
def test_bad_values_are_one_line_naming_the_flag(kw, needle):
    with pytest.raises(BadInput) as e:
        validate(TrainConfig(**kw))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_warmup_fraction_rounds_down_as_the_benchmark_does():
    assert TrainConfig(warmup_fraction=0.2).warmup_steps(585) == 117
    assert TrainConfig(warmup_fraction=0.2).warmup_steps(1875) == 375
    assert TrainConfig(warmup_fraction=0.2).warmup_steps(4) == 0
    assert TrainConfig(warmup=30).warmup_steps(585) == 30
    validate(TrainConfig(warmup_fraction=0.0, label_smoothing=0.0))


def test_label_smoothing_on_a_regression_dataset_is_refused_before_training(tmp_path):
    import shmlearn
    with pytest.raises(BadInput, match=r"--label-smoothing 0.1: only for classification; line is a regression"):
        shmlearn.train(TrainConfig(dataset="line", model="linreg", workers=1, device="cpu", label_smoothing=0.1,
                                   samples=64, out=str(tmp_path / "run"), progress=False))


def test_label_smoothing_with_your_own_loss_is_refused(tmp_path):
    import shmlearn
    with pytest.raises(BadInput, match="your own loss= replaces it"):
        shmlearn.train(TrainConfig(dataset="digits", model="softmax", workers=1, device="cpu", label_smoothing=0.1,
                                   samples=64, out=str(tmp_path / "run"), progress=False),
                       loss=F.cross_entropy)
