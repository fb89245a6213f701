"""User files that fail at import (issue 53): a strategy file on SHMLEARN_STRATEGY_PATH, a --model,
--dataset or --loss file that raises, holds a syntax error, calls sys.exit or imports what is not
installed. Owed: one line naming the file, exit 2, no worker started. A file that never returns
from its import is ended by Ctrl-C: exit 130, one line."""
from __future__ import annotations

import functools
import os
import signal

from benchmarks.faults import registry
from benchmarks.faults.core import TINY, Cmd
from benchmarks.faults.during import signal_group, when_exists
from benchmarks.faults.registry import out_of, write

case = functools.partial(registry.case, klass="imports")

BODIES = {
    "raises": "raise RuntimeError('boom at import')\n",
    "syntax-error": "def broken(:\n    pass\n",
    "sys-exit": "import sys\nsys.exit(3)\n",
    "missing-package": "import no_such_package_shmlearn_fault\n",
}
"""What a user file does at import, before its names exist."""
GOOD_MODEL = "import torch\n\n\ndef Net(spec):\n    return torch.nn.Linear(64, 10)\n"


def _loops(mark: str) -> str:
    return f"import time\nopen({mark!r}, 'w').close()\nwhile True:\n    time.sleep(0.1)\n"


def _strategy_dir(t: str, body: str) -> str:
    d = out_of(t, "strategies")
    write(os.path.join(d, "mine.py"), body)
    return d


for _how, _body in BODIES.items():
    for _cmd in ("train", "sweep"):
        @case(f"import-strategy-{_how}-{_cmd}", "53", f"{_cmd} with a strategy file on SHMLEARN_STRATEGY_PATH that "
              f"{_how.replace('-', ' ')} at import")
        def _(t, body=_body, cmd=_cmd):
            env = {"SHMLEARN_STRATEGY_PATH": _strategy_dir(t, body)}
            args = TINY + ["--out", out_of(t)] if cmd == "train" else \
                ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
                 "--lr", "0.1,0.2", "--no-report", "--no-progress", "--out", out_of(t, "s")]
            return [Cmd(args, 2, env=env, says=["mine.py"], limit=120)]

    for _flag in ("model", "dataset", "loss"):
        @case(f"import-{_flag}-{_how}", "53", f"train --{_flag} FILE.py:NAME whose file {_how.replace('-', ' ')} "
              f"at import")
        def _(t, body=_body, flag=_flag):
            path = write(out_of(t, f"my_{flag}.py"), body)
            args = [a for a in TINY if a not in ("--model", "softmax")] if flag == "model" else TINY
            if flag == "dataset":
                args = [a for a in TINY if a not in ("--dataset", "digits")]
            return [Cmd(args + [f"--{flag}", f"{path}:thing", "--out", out_of(t)], 2, says=[f"my_{flag}.py"],
                        limit=120)]


@case("import-model-module-missing", "53", "train --model no_such_pkg.module:Net (a module that does not exist)")
def _(t):
    args = [a for a in TINY if a not in ("--model", "softmax")]
    return [Cmd(args + ["--model", "no_such_pkg_shmlearn.module:Net", "--out", out_of(t)], 2,
                says=["no_such_pkg_shmlearn"])]


@case("import-strategy-help", "53", "train --help with a strategy file on SHMLEARN_STRATEGY_PATH that raises at "
      "import: the help, or one line")
def _(t):
    env = {"SHMLEARN_STRATEGY_PATH": _strategy_dir(t, BODIES["raises"])}
    return [Cmd(["train", "--help"], {0, 2}, env=env)]


SIGINT = signal_group(signal.SIGINT)
for _what in ("model", "dataset", "strategy"):
    @case(f"import-{_what}-loops-then-ctrl-c", "53", f"a {_what} file whose import never returns; Ctrl-C once it "
          f"is importing")
    def _(t, what=_what):
        mark = out_of(t, "importing")
        body = _loops(mark)
        env = {}
        if what == "strategy":
            env["SHMLEARN_STRATEGY_PATH"] = _strategy_dir(t, body)
            args = TINY + ["--out", out_of(t)]
        else:
            path = write(out_of(t, f"my_{what}.py"), body)
            drop = ("--model", "softmax") if what == "model" else ("--dataset", "digits")
            args = [a for a in TINY if a not in drop] + [f"--{what}", f"{path}:thing", "--out", out_of(t)]
        return [Cmd(args, 130, env=env, says=["interrupted"], during=when_exists(mark, SIGINT), limit=120)]


@case("import-model-good-dataset-raises-w2", "53", "a 2-worker run: --model fine, --dataset FILE raising at import")
def _(t):
    model = write(out_of(t, "my_model.py"), GOOD_MODEL)
    data = write(out_of(t, "my_dataset.py"), BODIES["raises"])
    return [Cmd(["train", "--model", f"{model}:Net", "--dataset", f"{data}:thing", "--workers", "2", "--samples",
                 "1024", "--no-progress", "--out", out_of(t)], 2, says=["my_dataset.py"], limit=120)]
