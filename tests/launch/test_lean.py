"""launch/lean.py: the program's one-process runs that compile nothing never import torch._dynamo,
and train exactly as a run that does (issue 52, warm start). Each case is a fresh interpreter: this
one imported Dynamo long ago."""
import json
import os
import subprocess
import sys

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
