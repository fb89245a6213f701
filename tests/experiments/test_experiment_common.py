"""experiments/common.py: a finished run with the same config is read back (with its extras), not
trained again; an experiment folder resumes only the invocation that made it."""
import pytest

import shmlearn.experiments.common as common
from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput
from shmlearn.experiments import run_experiment
from shmlearn.experiments.common import Context, run

CFG = TrainConfig(model="softmax", dataset="digits", workers=1, batch_size=64, samples=640, eval_points=1,
                  threads=1)


def _no_training(cfg):
    raise AssertionError(f"trained again: {cfg.out}")


def _weight_sum(model):
    return {"weight_sum": float(sum(p.detach().sum() for p in model.parameters()))}


def test_a_finished_run_is_read_back_with_its_extras_and_a_changed_one_is_refused(tmp_path, monkeypatch):
    ctx = Context(out=str(tmp_path), device="cpu")
    first = run(ctx, "a", CFG, extras=_weight_sum)
    assert first["status"] == "completed" and isinstance(first["_extras"]["weight_sum"], float)

    monkeypatch.setattr(common, "train", _no_training)
    again = run(ctx, "a", CFG, extras=_weight_sum)
    assert again["_run_dir"] == first["_run_dir"] and again["_extras"] == first["_extras"]
    assert {k: again[k] for k in ("steps", "final_loss", "wall_time_s")} == \
           {k: first[k] for k in ("steps", "final_loss", "wall_time_s")}

    monkeypatch.undo()
    # another config in the same folder is refused, and the finished run is left as it was
    with pytest.raises(BadInput, match="already holds a run"):
        run(ctx, "a", TrainConfig(**{**CFG.to_dict(), "lr": CFG.lr * 2}))
    assert run(ctx, "b", TrainConfig(**{**CFG.to_dict(), "lr": CFG.lr * 2}))["lr"] == CFG.lr * 2
    monkeypatch.setattr(common, "train", _no_training)
    assert run(ctx, "a", CFG)["final_loss"] == first["final_loss"]


def test_the_same_experiment_resumes_and_another_is_refused(tmp_path, monkeypatch):
    out = str(tmp_path / "exp")
    table = run_experiment("linreg-gd", quick=True, device="cpu", out=out)
    monkeypatch.setattr(common, "train", _no_training)
    assert run_experiment("linreg-gd", quick=True, device="cpu", out=out) == table  # nothing retrained
    with pytest.raises(BadInput, match="holds another experiment run .*experiment 'linreg-gd'"):
        run_experiment("single-neuron", quick=True, device="cpu", out=out)
    with pytest.raises(BadInput, match="quick True"):
        run_experiment("linreg-gd", device="cpu", out=out)
