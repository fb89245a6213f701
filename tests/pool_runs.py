"""A script that runs the `shmlearn` program's main as the program does (`program` True: its own
process, whose pools may be lean) or as a user's script would, recording how each pool worker
started and whether it had torch._dynamo when it was ready (tests/launch/test_lean*.py). Format
it with program, full (True: no pool is lean, the reference a lean run trains as), argv (the
command line, --out included) and out; it prints one JSON line."""

POOL_RUN = """
import json, sys
from shmlearn.user import user_main
if {program}:
    user_main.program_owns_main()
if {full}:
    from shmlearn.launch import lean
    lean.compiles_nothing = lambda cfg: False
from shmlearn.launch import pool as P
seen = []
close = P.Pool.close
def recording_close(self):
    seen.extend(self.startup)
    close(self)
P.Pool.close = recording_close
from shmlearn.cli import main
rc = main.main({argv!r}, early_workers={program})
s = json.load(open({out!r} + "/summary.json"))
print(json.dumps({{"rc": rc, "dynamo": "torch._dynamo" in sys.modules, "final_loss": s["final_loss"],
                  "test_accuracy": s["test_accuracy"], "strategy": s["strategy"],
                  "workers": [(w["start"], w["dynamo"]) for w in seen]}}))
"""
