"""A script with its training code at module level (no `if __name__ == "__main__":`), as
pytorch/examples' scripts are, trains at 2 workers: each pool worker runs the script up to its
shmlearn.train call and no further (shmlearn/user/user_main.py), so the code after the call runs once,
in the script's own process; a script with a main guard runs as before."""
import os
import subprocess
import sys

import pytest

FLAT = r"""
import os, sys
import torch
from torch import nn
import shmlearn

with open(sys.argv[1] + ".top", "a") as f:        # module level: every worker runs it too
    f.write(f"{os.getpid()}\n")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.layers(x)


def loss(out, y):                                  # defined here, passed below: workers need it
    return nn.functional.cross_entropy(out, y)


result = shmlearn.train(shmlearn.TrainConfig(workers=2, samples=1280, device="cpu", progress=False,
                                             out=sys.argv[1]), model=Net, loss=loss)
with open(sys.argv[1] + ".after", "a") as f:      # after the call: the script's own process only
    f.write(f"{os.getpid()} {result.status}\n")
"""


@pytest.mark.parametrize("forkserver", ["1", "0"], ids=["forked-workers", "spawned-workers"])
def test_a_script_training_at_module_level_runs_the_code_after_train_once(tmp_path, forkserver):
    script = tmp_path / "flat.py"
    script.write_text(FLAT)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTEST_CURRENT_TEST")}
    r = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(env, PYTHONPATH=os.pathsep.join(sys.path), SHMLEARN_FORKSERVER=forkserver))
    assert r.returncode == 0, r.stderr[-3000:]
    after = (tmp_path / "run.after").read_text().split()
    assert after == [str(after[0]), "completed"]  # once, completed
    tops = (tmp_path / "run.top").read_text().split()
    assert len(tops) == 3 and after[0] in tops  # the script's process and its 2 workers


CONSOLE = "from shmlearn.cli.main import entry\nentry()\n"
"""A `shmlearn` console script without pip's `if __name__ == "__main__":` guard."""


def test_the_programs_console_script_is_not_run_again_in_its_workers(tmp_path):
    """The campaign's cwd-shmlearn-folder-sweep: every pool worker ran the console script as the
    user's, i.e. the whole sweep again, which found the sweep's lock held and exited 2: each trial
    'worker died (exited with code 2)'. The program's workers import no script."""
    script = tmp_path / "shmlearn-script"
    script.write_text(CONSOLE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTEST_CURRENT_TEST")}
    out = tmp_path / "s"
    r = subprocess.run([sys.executable, str(script), "sweep", "--dataset", "digits", "--model", "softmax",
                        "--samples", "512", "--workers", "1", "--lr", "0.1,0.2", "--no-report", "--no-progress",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(env, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
