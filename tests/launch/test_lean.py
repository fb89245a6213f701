"""launch/lean.py: the program's one-process runs that compile nothing never import torch._dynamo,
and train exactly as a run that does (issue 52, warm start). Each case is a fresh interpreter: this
one imported Dynamo long ago."""
import json
import os
import subprocess
import sys

from pool_runs import POOL_RUN

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _py(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_optimizers_run_their_plain_methods_without_importing_dynamo():
    out = _py("""
import json, sys, torch
from shmlearn.launch import lean
on = lean.skip_dynamo_in_optimizers()
torch.manual_seed(0)
m = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
m(torch.ones(4, 3)).sum().backward()
from shmlearn.step.options import fused_why_not
why = fused_why_not(torch.optim.SGD, torch.device("cpu"))
def twice_(x: torch.Tensor) -> torch.Tensor:
    return x * 2
torch.library.custom_op("lean_test::twice", twice_, mutates_args=())  # wraps its kernel in _disable_dynamo
twice = torch.ops.lean_test.twice(torch.ones(2)).tolist()
sd = opt.state_dict()
opt.load_state_dict(sd)
opt.zero_grad()
print(json.dumps({"on": on, "again": lean.skip_dynamo_in_optimizers(), "active": lean.active(), "why": why,
                  "grad": m.weight.grad, "twice": twice, "dynamo": "torch._dynamo" in sys.modules}, default=str))
""")
    assert out == {"on": True, "again": True, "active": True, "why": None, "grad": None, "twice": [2.0, 2.0],
                   "dynamo": False}


def test_nothing_is_done_once_dynamo_is_imported():
    out = _py("""
import json, torch, torch._dynamo
from shmlearn.launch import lean
print(json.dumps({"on": lean.skip_dynamo_in_optimizers(), "active": lean.active()}))
""")
    assert out == {"on": False, "active": False}


RUN = """
import json, sys
from shmlearn.user import user_main
if {program}:
    user_main.program_owns_main()
from shmlearn.cli import main
rc = main.main(["train", "--workers", "1", "--threads", "1", "--samples", "4096", "--no-progress", "--out", {out!r}])
s = json.load(open({out!r} + "/summary.json"))
print(json.dumps({{"rc": rc, "dynamo": "torch._dynamo" in sys.modules, "final_loss": s["final_loss"],
                  "test_accuracy": s["test_accuracy"], "step_mode": s["step_mode"]}}))
"""


def test_the_programs_one_worker_run_skips_dynamo_and_trains_the_same(tmp_path):
    lean = _py(RUN.format(program=True, out=str(tmp_path / "lean")))
    api = _py(RUN.format(program=False, out=str(tmp_path / "api")))  # a user's script: Dynamo as before
    assert lean["rc"] == api["rc"] == 0
    assert (lean["dynamo"], api["dynamo"]) == (False, True)
    assert lean["step_mode"] == api["step_mode"]
    # The same kernels: one thread each (an unpinned count follows the cores free, and a sum split
    # over another count of threads rounds differently: seen under load).
    assert (lean["final_loss"], lean["test_accuracy"]) == (api["final_loss"], api["test_accuracy"])




def _run2(program: bool, out: str, full: bool = False) -> str:
    argv = ["train", "--workers", "2", "--threads", "1", "--samples", "4096", "--no-progress", "--out", out]
    return POOL_RUN.format(program=program, full=full, argv=argv, out=out)


def test_the_programs_cpu_pool_run_is_lean_forks_from_it_and_trains_the_same(tmp_path):
    """`shmlearn train --workers 2 --threads 1` on the CPU (the README's first command on 2 cores):
    no forkserver, the two workers fork from the program and neither it nor they import
    torch._dynamo; a user's script's train() of the same config is lean too, and forks from the
    script; a pool that is not lean (its workers import Dynamo) gets the same losses to the bit."""
    lean = _py(_run2(True, str(tmp_path / "lean")))
    script = _py(_run2(False, str(tmp_path / "script")))
    full = _py(_run2(False, str(tmp_path / "full"), full=True))
    assert lean["rc"] == script["rc"] == full["rc"] == 0
    assert lean["workers"] == script["workers"] == [["fork", False], ["fork", False]], (lean, script)
    assert lean["dynamo"] is False and script["dynamo"] is False
    assert all(d for _, d in full["workers"]), full["workers"]
    assert (lean["final_loss"], lean["test_accuracy"]) == (full["final_loss"], full["test_accuracy"])
    assert (script["final_loss"], script["test_accuracy"]) == (full["final_loss"], full["test_accuracy"])


def test_which_cpu_train_runs_are_lean():
    from shmlearn.cli.main import _lean_train
    from shmlearn.config.limits import usable_cores
    assert _lean_train(["train", "--device", "cpu", "--threads", "1"]) == "caller"
    assert _lean_train(["train", "--device", "cpu", "--workers", str(usable_cores())]) == "caller"
    assert _lean_train(["train", "--device", "cpu", "--workers", "1", "--threads", "2"]) == "forkserver"
    assert _lean_train(["train", "--device", "cpu", "--compile", "default"]) is None
    assert _lean_train(["train", "--device", "cpu", "--config", "r.yaml"]) is None
    assert _lean_train(["train", "--device", "cpu", "--workers", "two"]) is None
    assert _lean_train(["sweep", "--device", "cpu"]) is None


FIRST_STEP = """
import json, sys
from shmlearn.user import user_main
user_main.program_owns_main()
from shmlearn.step import fast
at_first = []
run = fast.Stepper.run
def recording_run(self, *a, **k):
    if not at_first:
        at_first.append("torch._dynamo" in sys.modules)
    return run(self, *a, **k)
fast.Stepper.run = recording_run
from shmlearn.cli import main
rc = main.main(["train", "--workers", "1", "--threads", "1", "--samples", "2048", "--no-progress",
                "--out", {out!r}] + {extra!r})
print(json.dumps({{"rc": rc, "at_first_step": at_first[0], "dynamo": "torch._dynamo" in sys.modules}}))
"""


def test_a_lean_run_whose_step_calls_the_optimizers_step_imports_dynamo_before_its_first_step(tmp_path):
    """torch.optim's step() imports torch._dynamo at its first call: a lean run (launch/lean.py)
    whose step calls it (Adam's step, not the flat SGD update) imports it during setup, so its
    first timed step does not pay the import; one on the flat SGD update never imports it."""
    adam = _py(FIRST_STEP.format(out=str(tmp_path / "adam"), extra=["--optimizer", "adam", "--lr", "0.01"]))
    sgd = _py(FIRST_STEP.format(out=str(tmp_path / "sgd"), extra=[]))
    assert adam == {"rc": 0, "at_first_step": True, "dynamo": True}
    assert sgd == {"rc": 0, "at_first_step": False, "dynamo": False}
