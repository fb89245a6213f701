"""The campaign's cases: one registry, filled by the class modules as they are imported, and the
finished runs some cases start from (fixtures, built once per campaign and copied per case)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from benchmarks.faults.core import Cmd, clean_env, code, orphans_after

LEGACY = ("issue15", "issue38")
"""Classes of the earlier rounds: run from the repository as their cwd, as they always were."""


@dataclass
class Case:
    name: str
    item: str
    """The issue's item ('1'..'15', 'cosmetic', 'classic', '38.N', '53')."""
    what: str
    build: Callable[[str], List[Cmd]]
    """tmp dir -> the commands, run in order; later ones may read what earlier ones wrote."""
    check: Optional[Callable[[str, List[Dict[str, Any]]], List[str]]] = None
    """After all commands: what was lost or torn (a list of problems)."""
    repeat: int = 1
    between: Optional[Callable[[str], None]] = None
    """Between the first and second command (damage a checkpoint)."""
    concurrent: bool = False
    """Start the second command while the first runs (see run_concurrent)."""
    klass: str = "issue15"
    """The class --class runs: issue15, issue38, or one of issue 53's."""
    keep: Optional[Callable[[str], List[str]]] = None
    """tmp dir -> folders whose files as they were after build() must be there unchanged after the
    commands (new files are allowed); a change counts as lost."""


CASES: List[Case] = []


def case(name, item, what, *, check=None, repeat=1, between=None, concurrent=False, klass="issue15", keep=None):
    def deco(build):
        if any(c.name == name for c in CASES):
            raise ValueError(f"two cases named {name}")
        CASES.append(Case(name, item, what, build, check, repeat, between, concurrent, klass, keep))
        return build
    return deco


def out_of(tmp: str, sub: str = "run") -> str:
    return os.path.join(tmp, sub)


def write(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


FIXTURES: Dict[str, List[str]] = {
    "run": ["train", "--dataset", "digits", "--model", "softmax", "--samples", "4096", "--workers", "1",
            "--batch-size", "32", "--eval-points", "2", "--noise-scale", "--no-progress"],
    "ckpt": ["train", "--dataset", "digits", "--model", "mlp", "--samples", "6400", "--workers", "2",
             "--batch-size", "32", "--eval-points", "2", "--checkpoint-every", "20", "--no-progress"],
    "sweep": ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "2048", "--workers", "1",
              "--lr", "0.1,0.2", "--noise-scale", "--no-report", "--no-progress"],
}
"""A finished 1-worker run with noise-scale rows (report, advise, simulate --compute, --resume);
a 2-worker run stopped by a fault at step 70 with checkpoints at 20, 40, 60 (--resume reads them);
a finished sweep of two trials with noise-scale rows."""
FIXTURE_FAULT = {"ckpt": "raise:0:70"}


def fixture(tmp: str, name: str, dest: str = "run") -> str:
    """A copy of fixture `name` at tmp/dest; built on first use under the campaign's work folder
    (tmp's parent), by the shmlearn under test."""
    src = os.path.join(os.path.dirname(tmp), "_fixtures", name)
    if not os.path.isdir(src):
        tag = uuid.uuid4().hex
        env = clean_env(tag, {"SHMLEARN_FAULT": FIXTURE_FAULT[name]} if name in FIXTURE_FAULT else None)
        p = subprocess.run([sys.executable, "-m", "shmlearn", *FIXTURES[name], "--out", src + ".part"],
                           cwd=code(), env=env, capture_output=True, text=True, timeout=600)
        orphans_after(tag)
        if p.returncode != (1 if name in FIXTURE_FAULT else 0):
            raise RuntimeError(f"fixture {name}: exit {p.returncode}: {p.stderr[-500:]}")
        os.rename(src + ".part", src)
    out = os.path.join(tmp, dest)
    shutil.copytree(src, out, symlinks=True)
    return out
