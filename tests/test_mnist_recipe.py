"""pytorch/examples' mnist recipe, small (issue 41): its Net (two convs, max-pool, dropout, two
linear layers, log_softmax), Adadelta at lr 1.0, StepLR gamma 0.7 stepped per epoch, nll_loss;
here on the 8x8 digits so it runs in seconds, 2 Gloo workers. Through the CLI and the Python
API with the same weights; a rerun from the run's config.yaml gives the same weights bit for
bit; shmlearn.load_model(run) scores the run's own test accuracy."""
import json
import os
import sys
import textwrap

import pytest
import torch
from cli_inproc import run_main

import shmlearn
from shmlearn import TrainConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from mnist_port import net_source  # noqa: E402 - the benchmark's Net, not a copy


RECIPE_PY = net_source(conv=(8, 16), hidden=32, flat=64, note=", narrowed for 8x8 images")
"""pytorch/examples' Net from benchmarks/mnist_port.py, narrowed for the 8x8 digits."""
RECIPE = ["--optimizer", "Adadelta", "--optimizer-args", "lr=1.0", "--scheduler", "StepLR",
          "--scheduler-args", "step_size=1,gamma=0.7"]


def _cli(cwd, monkeypatch, capfd, *args):
    """The CLI's main() in this process, run in `cwd` (tests/cli_inproc.py): the test is about what
    the command trains, not the program's process; a fresh interpreter apiece was ~3 s of imports
    on two cores. Its 2 workers are real Gloo processes either way."""
    monkeypatch.chdir(cwd)
    r = run_main(args, monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    return r


def _flat(model):
    return torch.cat([t.reshape(-1) for t in model.state_dict().values()])


def _accuracy(model):
    from shmlearn.data import load_dataset, normalizer
    d = load_dataset("digits")
    with torch.no_grad():
        out = model(normalizer(d, torch.device("cpu"))(d.test_x))
    return (out.argmax(1) == d.test_y).float().mean().item()


@pytest.fixture
def recipe(tmp_path):
    (tmp_path / "mnist_recipe.py").write_text(textwrap.dedent(RECIPE_PY))
    return tmp_path


def test_the_mnist_recipe_through_cli_and_api_and_again_from_config_yaml(recipe, monkeypatch, capfd):
    common = ["--model", "mnist_recipe.py:Net", "--loss", "mnist_recipe.py:nll", "--workers", "2",
              "--epochs", "2", "--batch-size", "32", "--device", "cpu", "--no-progress", *RECIPE]
    _cli(recipe, monkeypatch, capfd, "train", *common, "--out", "cli")
    _cli(recipe, monkeypatch, capfd, "train", "--config", "cli/config.yaml", "--out", "again")
    with open(recipe / "cli" / "summary.json") as f:
        s = json.load(f)
    assert (s["status"], s["optimizer"], s["scheduler"], s["loss"]) == \
        ("completed", "Adadelta", "StepLR", "mnist_recipe.py:nll")
    assert s["scheduler_interval"] == "epoch" and s["start_lrs"] == [1.0]
    # Adadelta runs its foreach implementation in the fast step, behind step/gate.py (issue 51)
    assert s["step_mode"] == "fast-eager" and s["weights"] in ("model.safetensors", "model.pt")
    cwd = os.getcwd()
    os.chdir(recipe)  # the references are relative to where the run was started, as on the CLI
    try:
        api = shmlearn.train(TrainConfig(model="mnist_recipe.py:Net", loss="mnist_recipe.py:nll", workers=2,
                                         epochs=2, batch_size=32, device="cpu", progress=False, out="api",
                                         optimizer="Adadelta", optimizer_args="lr=1.0", scheduler="StepLR",
                                         scheduler_args="step_size=1,gamma=0.7"))
        cli, again = shmlearn.load_model("cli"), shmlearn.load_model("again")
    finally:
        os.chdir(cwd)
    assert torch.equal(_flat(cli), _flat(again)), "a rerun from config.yaml is not the same run"
    assert torch.equal(_flat(cli), _flat(api.model.eval())), "the API and the CLI trained differently"
    assert _accuracy(cli) == pytest.approx(s["test_accuracy"], abs=1.5 / 360)
    assert s["test_accuracy"] > 0.5  # 44 steps of a small conv net; chance is 0.1


def test_load_model_of_a_built_in_model_scores_its_runs_accuracy(tmp_path):
    r = shmlearn.train(TrainConfig(workers=1, threads=1, samples=32 * 60, progress=False, out=str(tmp_path / "run")))
    model = shmlearn.load_model(r.run_dir)
    assert not model.training
    assert _accuracy(model) == pytest.approx(r.summary["test_accuracy"], abs=1.5 / 360)
    assert torch.equal(_flat(model), _flat(r.model))


def test_no_weights_is_one_line(tmp_path):
    r = shmlearn.train(TrainConfig(workers=1, samples=32 * 2, save_model=False, progress=False,
                                   out=str(tmp_path / "run")))
    assert r.summary["weights"] is None
    with pytest.raises(shmlearn.BadInput, match="no model.safetensors or model.pt"):
        shmlearn.load_model(r.run_dir)
