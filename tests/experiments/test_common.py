"""experiments/common.py: a finished run with the same config is read back, not trained again."""
import pytest

import shmlearn.experiments.common as common
from shmlearn.config import TrainConfig
from shmlearn.errors import BadInput
from shmlearn.experiments.common import Context, run

CFG = TrainConfig(model="softmax", dataset="digits", workers=1, batch_size=64, samples=640, eval_points=1,
                  threads=1)


def test_a_finished_run_is_read_back_and_a_changed_one_trains(tmp_path, monkeypatch):
    ctx = Context(out=str(tmp_path), device="cpu")
    first = run(ctx, "a", CFG)
    assert first["status"] == "completed" and "_model" in first

    def no_training(cfg):
        raise AssertionError(f"trained again: {cfg.out}")

    monkeypatch.setattr(common, "train", no_training)
    again = run(ctx, "a", CFG)
    assert again["_run_dir"] == first["_run_dir"] and "_model" not in again
    assert {k: again[k] for k in ("steps", "final_loss", "wall_time_s")} == \
           {k: first[k] for k in ("steps", "final_loss", "wall_time_s")}

    monkeypatch.undo()
    # another config in the same folder is refused, and the finished run is left as it was
    with pytest.raises(BadInput, match="already holds a run"):
        run(ctx, "a", TrainConfig(**{**CFG.to_dict(), "lr": CFG.lr * 2}))
    assert run(ctx, "b", TrainConfig(**{**CFG.to_dict(), "lr": CFG.lr * 2}))["lr"] == CFG.lr * 2
    monkeypatch.setattr(common, "train", no_training)
    assert run(ctx, "a", CFG)["final_loss"] == first["final_loss"]
