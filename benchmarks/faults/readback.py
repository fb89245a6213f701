"""Corrupt files read back (issue 53): a run's summary.json, config.yaml, metrics.jsonl and
eval.jsonl, a sweep's sweep.json and results.jsonl, checkpoints and model.pt, each damaged one way
and read by each command that reads it. Owed: one line naming the file, exit 2, and the folder
as it was (new files allowed; nothing already there changed)."""
from __future__ import annotations

import functools
import json
import os
import shutil
from typing import Callable, Dict, List

from benchmarks.faults import registry
from benchmarks.faults.core import Cmd
from benchmarks.faults.registry import FIXTURES, fixture, out_of, write
from benchmarks.faults.written import summary

case = functools.partial(registry.case, klass="readback")


def _keep_run(t):
    return [out_of(t)]


def _keep_sweep(t):
    return [out_of(t, "s")]


# --- how a file is damaged ----------------------------------------------------------------------

def _text(text: str) -> Callable[[str], None]:
    return lambda path: write(path, text)


def _json_edit(edit: Callable[[dict], None]) -> Callable[[str], None]:
    def apply(path: str) -> None:
        with open(path) as f:
            d = json.load(f)
        edit(d)
        write(path, json.dumps(d))
    return apply


def _jsonl_edit(edit: Callable[[List[str]], List[str]]) -> Callable[[str], None]:
    def apply(path: str) -> None:
        with open(path) as f:
            lines = f.read().splitlines()
        write(path, "\n".join(edit(lines)) + "\n")
    return apply


def _rows_edit(edit: Callable[[dict], None]) -> Callable[[List[str]], List[str]]:
    def apply(lines: List[str]) -> List[str]:
        rows = [json.loads(x) for x in lines if x.strip()]
        for r in rows:
            edit(r)
        return [json.dumps(r) for r in rows]
    return apply


def _remove(path: str) -> None:
    os.remove(path)


def _to_dir(path: str) -> None:
    os.remove(path)
    os.mkdir(path)


def _set(key: str, value) -> Callable[[dict], None]:
    return lambda d: d.__setitem__(key, value)


def _drop_workers(row: dict) -> None:
    """A results.jsonl row without its worker count: the trial's config holds it (config.workers)."""
    row.pop("workers", None)
    row.get("config", {}).pop("workers", None)


def _first_row(edit: Callable[[dict], None]) -> Callable[[List[str]], List[str]]:
    def apply(lines: List[str]) -> List[str]:
        row = json.loads(lines[0])
        edit(row)
        return [json.dumps(row)] + lines[1:]
    return apply


def _garbage_after(n: int, junk: str = "not json {") -> Callable[[List[str]], List[str]]:
    return lambda lines: lines[:n] + [junk] + lines[n:]


DAMAGE: Dict[str, Callable[[str], None]] = {
    "not-json": _text('{"status": "compl'),
    "a-list": _text("[1, 2]\n"),
    "null": _text("null\n"),
    "string-accuracy": _json_edit(_set("test_accuracy", "high")),
    "yaml-list": _text("- 1\n- 2\n"),
    "not-yaml": _text("lr: [0.1\nworkers: {\n"),
    "garbage-line": _jsonl_edit(_garbage_after(2)),
    "garbage-middle": _jsonl_edit(_garbage_after(1)),
    "list-row": _jsonl_edit(_garbage_after(2, "[1, 2]")),
    "missing": _remove,
    "eval-string-accuracy": _jsonl_edit(_rows_edit(_set("test_accuracy", "high"))),
    "row-without-workers": _jsonl_edit(_first_row(_drop_workers)),
    "summary-null": _jsonl_edit(_first_row(_set("summary", None))),
    "a-directory": _to_dir,
}

# --- a run directory ----------------------------------------------------------------------------

RUN_CMDS: Dict[str, Callable[[str, str], List[str]]] = {
    "report": lambda run, t: ["report", run],
    "advise": lambda run, t: ["advise", run, "--out", out_of(t, "adv")],
    "simulate": lambda run, t: ["simulate", "--net-bw", "10", "--compute", run, "--out", out_of(t, "sim")],
    "resume": lambda run, t: FIXTURES["ckpt"] + ["--resume", "--out", run],
}
"""The commands that read a run directory back; resume reads the stopped run (checkpoints at 20,
40, 60), the others the finished one."""
RUN_MATRIX = [  # (file, damage, commands)
    ("summary.json", "not-json", ("report", "advise", "simulate", "resume")),
    ("summary.json", "a-list", ("report", "advise", "simulate", "resume")),
    ("summary.json", "null", ("report", "advise", "simulate")),
    ("summary.json", "string-accuracy", ("report", "advise")),
    ("config.yaml", "yaml-list", ("report", "advise", "simulate", "resume")),
    ("config.yaml", "not-yaml", ("report", "resume")),
    ("metrics.jsonl", "garbage-line", ("advise", "report", "resume")),
    ("metrics.jsonl", "list-row", ("advise", "report")),
    ("metrics.jsonl", "missing", ("advise",)),
    ("eval.jsonl", "eval-string-accuracy", ("report",)),
    ("eval.jsonl", "list-row", ("report",)),
]
for _file, _how, _cmds in RUN_MATRIX:
    for _cmd in _cmds:
        @case(f"read-{_cmd}-{_file.split('.')[0]}-{_how}", "53", f"{_cmd} of a run whose {_file} is damaged: {_how}",
              keep=_keep_run)
        def _(t, file=_file, how=_how, cmd=_cmd):
            run = fixture(t, "ckpt" if cmd == "resume" else "run")
            DAMAGE[how](os.path.join(run, file))
            return [Cmd(RUN_CMDS[cmd](run, t), 2, says=[file], limit=120)]


@case("read-report-metrics-missing", "53", "report of a finished run without metrics.jsonl: its summary alone, or "
      "one line", keep=_keep_run)
def _(t):
    run = fixture(t, "run")
    os.remove(os.path.join(run, "metrics.jsonl"))
    return [Cmd(["report", run], {0, 2}, limit=120)]


# --- a sweep directory --------------------------------------------------------------------------

SWEEP_CMDS: Dict[str, Callable[[str, str], List[str]]] = {
    "report": lambda s, t: ["report", s],
    "advise": lambda s, t: ["advise", s, "--out", out_of(t, "adv")],
    "rerun": lambda s, t: FIXTURES["sweep"] + ["--out", s],
}
SWEEP_MATRIX = [
    ("sweep.json", "not-json", ("report", "advise", "rerun")),
    ("sweep.json", "a-list", ("report", "advise", "rerun")),
    ("results.jsonl", "row-without-workers", ("report", "advise", "rerun")),
    ("results.jsonl", "summary-null", ("report", "advise", "rerun")),
    ("results.jsonl", "a-directory", ("report", "advise", "rerun")),
    ("results.jsonl", "garbage-middle", ("report", "advise")),
]
for _file, _how, _cmds in SWEEP_MATRIX:
    for _cmd in _cmds:
        @case(f"read-sweep-{_cmd}-{_file.split('.')[0]}-{_how}", "53",
              f"{'the same sweep again' if _cmd == 'rerun' else _cmd} on a sweep whose {_file} is damaged: {_how}",
              keep=_keep_sweep)
        def _(t, file=_file, how=_how, cmd=_cmd):
            s = fixture(t, "sweep", "s")
            DAMAGE[how](os.path.join(s, file))
            return [Cmd(SWEEP_CMDS[cmd](s, t), 2, says=[file], limit=120)]


# --- checkpoints (--resume) ---------------------------------------------------------------------

def _zeros_like(x):
    import torch
    if isinstance(x, torch.Tensor):
        return torch.zeros(3, dtype=x.dtype)
    if isinstance(x, dict):
        return {k: _zeros_like(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_zeros_like(v) for v in x)
    return x


def _rewrite(state_of: Callable[[object], object]) -> Callable[[str], None]:
    """A checkpoint file whose envelope is sound (magic, checksum) and whose state is not."""
    def apply(path: str) -> None:
        from shmlearn.train.checkpoint import read_file, write_file
        write_file(path, state_of(read_file(path)))
    return apply


def _fifo(path: str) -> None:
    os.remove(path)
    os.mkfifo(path)


CKPT_DAMAGE: Dict[str, Callable[[str], None]] = {
    "a-list": _rewrite(lambda s: [1, 2, 3]),
    "missing-keys": _rewrite(lambda s: {k: v for k, v in list(s.items())[:1]}),
    "wrong-shapes": _rewrite(_zeros_like),
    "a-fifo": _fifo,
    "a-directory": _to_dir,
    "empty": _text(""),
}
for _how in CKPT_DAMAGE:
    @case(f"read-resume-checkpoint-{_how}", "53", f"--resume of a stopped run whose rank-0 checkpoint files "
          f"(steps 20, 40, 60) are each {_how.replace('-', ' ')}", keep=_keep_run)
    def _(t, how=_how):
        run = fixture(t, "ckpt")
        root = os.path.join(run, "checkpoints")
        for d in sorted(os.listdir(root)):
            if os.path.isfile(os.path.join(root, d, "rank0.ckpt")):
                CKPT_DAMAGE[how](os.path.join(root, d, "rank0.ckpt"))
        return [Cmd(RUN_CMDS["resume"](run, t), 2, says=["checkpoint"], limit=120)]


def _whole_run(t, results):
    if results and results[-1]["exit"] != 0:
        return []
    s = summary(out_of(t))
    return [] if s.get("samples_seen") == 6400 and s.get("steps") == s.get("planned_steps") == 100 else \
        [f"said {s.get('status')} after {s.get('samples_seen')} of 6400 samples ({s.get('steps')} steps)"]


@case("read-resume-checkpoint-renamed", "53", "--resume of a stopped run whose newest checkpoint folder (step 60) "
      "was renamed step-00000080: refused, or resumed from 60 (it said completed after 80 of 100 steps)",
      check=_whole_run)
def _(t):
    run = fixture(t, "ckpt")
    root = os.path.join(run, "checkpoints")
    shutil.move(os.path.join(root, "step-00000060"), os.path.join(root, "step-00000080"))
    return [Cmd(RUN_CMDS["resume"](run, t), {0, 2}, limit=180)]


# --- model.pt (load_model) -----------------------------------------------------------------------

LOAD = """import sys
import shmlearn
try:
    shmlearn.load_model(sys.argv[1])
except shmlearn.BadInput as e:
    print(f"load_model: {e}", file=sys.stderr)
    sys.exit(2)
"""
"""A user's script: BadInput is the promised refusal; anything else escapes as a traceback."""


def _torch_save(obj_of: Callable[[dict], object]) -> Callable[[str], None]:
    def apply(path: str) -> None:
        import torch
        blob = torch.load(path, map_location="cpu", weights_only=True)
        torch.save(obj_of(blob), path)
    return apply


MODEL_DAMAGE: Dict[str, Callable[[str], None]] = {
    "planted-bytes": _text("PK\x03\x04 not a torch file"),
    "a-list": _torch_save(lambda b: [1, 2, 3]),
    "missing-keys": _torch_save(lambda b: {"state_dict": b["state_dict"]}),
    "wrong-structure": _torch_save(lambda b: {"state_dict": [1, 2], "data_spec": {"nonsense": 1}}),
    "wrong-shapes": _torch_save(lambda b: {**b, "state_dict": _zeros_like(b["state_dict"])}),
    "a-fifo": _fifo,
}
for _how in MODEL_DAMAGE:
    @case(f"read-load-model-{_how}", "53", f"shmlearn.load_model(RUN) whose model.pt is {_how.replace('-', ' ')} "
          f"(a script catching BadInput)", keep=_keep_run)
    def _(t, how=_how):
        run = fixture(t, "run")
        MODEL_DAMAGE[how](os.path.join(run, "model.pt"))
        script = write(out_of(t, "load.py"), LOAD)
        return [Cmd([], 2, argv=[script, run], says=["model.pt"], limit=60)]
