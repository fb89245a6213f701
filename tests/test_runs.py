"""shmlearn/runs.py: the run directory's JSON files are JSON for every reader."""
import json
import math

from shmlearn.config import TrainConfig
from shmlearn.runs import RunDir


def _strict(text):
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_nan_and_inf_are_written_as_null_in_summary_and_eval(tmp_path):
    """Issue 38, 10: a NaN test loss was written as a bare NaN token into summary.json and
    eval.jsonl (invalid JSON outside Python). It is null; finite values are kept."""
    rd = RunDir(str(tmp_path / "run"), TrainConfig(out=str(tmp_path / "run")))
    rd.log_eval({"step": 10, "test_loss": math.nan, "test_accuracy": None, "other": [math.inf, 1.5]})
    rd.write_summary({"status": "completed", "test_loss": math.nan, "min_loss": -math.inf, "final_loss": 0.25,
                      "phase_s": {"compute": math.nan}})
    rd.close()
    row = _strict((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[0])
    assert row == {"step": 10, "test_loss": None, "test_accuracy": None, "other": [None, 1.5]}
    s = _strict((tmp_path / "run" / "summary.json").read_text())
    assert (s["test_loss"], s["min_loss"], s["final_loss"], s["phase_s"]) == (None, None, 0.25, {"compute": None})
