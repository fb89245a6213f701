"""models/user.py: the user's own model (a module, a class or a builder) and the one forward pass
that checks it against the data before any process group exists."""
import pytest
import torch
from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput
from shmlearn.models import build_model
from shmlearn.models.user import check_outputs, takes_spec, user_model

SPEC = DataSpec(name="user", task="classification", input_shape=(6,), num_outputs=3)
REG = DataSpec(name="user", task="regression", input_shape=(6,), num_outputs=1)


class Net(nn.Module):
    def __init__(self, spec=None):
        super().__init__()
        self.fc = nn.Linear(6, (spec or SPEC).num_outputs)

    def forward(self, x):
        return self.fc(x)


class NeedsSpec(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(spec.input_shape[0], spec.num_outputs)

    def forward(self, x):
        return self.fc(x)


def _one_line(e) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


def test_a_module_is_copied_with_its_weights_and_the_callers_stays_untouched():
    torch.manual_seed(1)
    mine = Net()
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    got = user_model(mine, SPEC, "model=")
    assert got is not mine
    for k, v in got.state_dict().items():
        assert torch.equal(v, before[k])
        assert v.data_ptr() != mine.state_dict()[k].data_ptr()
    with torch.no_grad():
        for p in got.parameters():
            p.add_(1.0)  # what training does to the copy
    for k, v in mine.state_dict().items():
        assert torch.equal(v, before[k]), f"{k}: the caller's module changed"


def test_a_class_with_a_required_argument_gets_the_dataspec():
    got = user_model(NeedsSpec, SPEC, "model=")
    assert isinstance(got, NeedsSpec) and got.spec is SPEC and got.fc.out_features == 3


def test_a_builder_is_called_as_it_is_declared():
    seen = []

    def with_spec(spec):
        seen.append(spec)
        return Net(spec)

    def without():
        seen.append(None)
        return Net()

    def optional(spec=None):  # an optional argument is left to its default
        seen.append(spec)
        return Net()

    assert user_model(with_spec, REG, "model=").fc.out_features == 1
    user_model(without, REG, "model=")
    user_model(optional, REG, "model=")
    assert seen == [REG, None, None]


def test_a_builder_gives_the_registry_s_weights_for_the_same_seed():
    torch.manual_seed(5)
    ref = build_model("mlp", SPEC)
    torch.manual_seed(5)
    got = user_model(lambda spec: build_model("mlp", spec), SPEC, "model=")
    for (k, a), (_, b) in zip(ref.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("fn,want", [
    (lambda: 0, False), (lambda spec: 0, True), (lambda spec=None: 0, False), (lambda *a: 0, False),
    (lambda *, spec: 0, False), (Net, False), (NeedsSpec, True),
])
def test_takes_spec(fn, want):
    assert takes_spec(fn) is want


def test_a_builder_that_raises_is_one_line_naming_the_argument():
    def build(spec):
        raise ValueError("hidden size must be even\nmore")
    with pytest.raises(BadInput) as e:
        user_model(build, SPEC, "model=")
    assert _one_line(e) == ("model=: test_a_builder_that_raises_is_one_line_naming_the_argument.<locals>.build() "
                            "raised ValueError: hidden size must be even")


def test_a_class_whose_init_raises_is_one_line():
    class Bad(nn.Module):
        def __init__(self, spec):
            super().__init__()
            raise KeyError("depth")
    with pytest.raises(BadInput) as e:
        user_model(Bad, SPEC, "--model net.py:Bad")
    msg = _one_line(e)
    assert msg.startswith("--model net.py:Bad: ") and "raised KeyError: 'depth'" in msg


@pytest.mark.parametrize("obj,words", [
    (lambda: "a string", "returned a str; expected a torch.nn.Module"),
    ("resnet", "expected a torch.nn.Module, or a class or callable returning one; got a str"),
    (nn.ReLU(), "has no trainable parameters"),
    (lambda: nn.Linear(6, 3).requires_grad_(False), "has no trainable parameters"),
])
def test_what_is_not_a_trainable_module_is_refused(obj, words):
    with pytest.raises(BadInput) as e:
        user_model(obj, SPEC, "model=")
    msg = _one_line(e)
    assert msg.startswith("model=: ") and words in msg, msg


def test_check_outputs_accepts_the_right_width():
    check_outputs(Net(), torch.randn(2, 6), SPEC, "model=")
    check_outputs(Net(REG), torch.randn(2, 6), REG, "model=")


@pytest.mark.parametrize("spec,width,words", [
    (SPEC, 2, "outputs have shape (2, 2) for 2 samples, but the data has 3 classes: expected (2, 3)"),
    (REG, 3, "outputs have shape (2, 3) for 2 samples, but the data has 1 target value(s) per sample: "
             "expected (2, 1)"),
])
def test_an_output_width_that_does_not_fit_the_data_is_one_line(spec, width, words):
    with pytest.raises(BadInput) as e:
        check_outputs(nn.Linear(6, width), torch.randn(2, 6), spec, "model=")
    assert _one_line(e) == f"model=: {words}"


def test_a_forward_that_raises_or_returns_no_tensor_is_one_line():
    with pytest.raises(BadInput) as e:
        check_outputs(nn.Linear(5, 3), torch.randn(2, 6), SPEC, "--model x.py:Net")
    msg = _one_line(e)
    assert msg.startswith("--model x.py:Net: a forward pass on 2 training samples of shape (6,) raised RuntimeError")

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(x), x
    with pytest.raises(BadInput) as e:
        check_outputs(Pair(), torch.randn(2, 6), SPEC, "model=")
    assert _one_line(e) == "model=: the forward pass returned a tuple; expected one tensor of scores"


def test_the_check_leaves_the_rng_and_the_training_mode_as_they_were():
    """The check runs between seeding and training: drawing random numbers (dropout) there
    would change the run; and the model must come back in training mode."""
    model = nn.Sequential(nn.Linear(6, 3), nn.Dropout(0.5))
    torch.manual_seed(3)
    state = torch.get_rng_state()
    check_outputs(model, torch.randn(2, 6, generator=torch.Generator().manual_seed(0)), SPEC, "model=")
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and model[1].training
    model.eval()
    check_outputs(model, torch.randn(2, 6), SPEC, "model=")
    assert not model.training
