"""The one reader of every file the program reads back: JSON, JSON lines, YAML, a run directory's
files and the raw bytes of checkpoints and weights.

Whatever is wrong with such a file (missing, a directory, a FIFO, not UTF-8, not JSON, a list
where an object belongs, a row without a key its reader needs, a string where a number belongs)
is one line naming the file (and the line, and the key) and what is wrong: BadInput, exit 2. A
reader never gets half-checked data to trip over later with a KeyError or a TypeError.

What each reader needs from a row is declared as a mapping {key: types} (`need`): a key it
reads is required, and typed; None in the types lets the key be null. Keys not declared pass
untouched (a newer writer's additions).

A JSON-lines file cut by a kill ends with a line without its newline: that one line is dropped
(`cut_ok`), as the writers' own `jsonl.mend` would move it aside; a bad line anywhere else is the
user's to fix, and named.

YAML is read with `yaml.SafeLoader`; a document whose aliases expand past `MAX_YAML_NODES` nodes
(an alias bomb: a few hundred bytes that expand to a billion) is refused before anything uses it,
and a value in a message is shown cut to `SHOWN` characters (`shown`), so no refusal prints more
than a line.
"""
from __future__ import annotations

import json
import os
import re
import reprlib
import stat
import functools
from typing import Any, Dict, Iterable, List, Optional, Tuple

from shmlearn.errors import BadInput

NUMBER = (int, float)
"""A JSON number (bool excluded by `need`)."""
MAX_YAML_NODES = 100_000
"""Nodes a YAML file may expand to through its aliases: a config has a few hundred; an alias
bomb (each level ten aliases of the one below) billions."""
MAX_BYTES = 1 << 30
"""Largest file read whole (1 GiB): a results.jsonl row is a few KB, so this is ~200,000 trials,
past MAX_TRIALS' 100,000 (sweeps/grid.py); a larger file is a wrong path, not a result."""
SHOWN = 60
"""Characters of a value a message shows."""

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict, _repr.maxlevel = SHOWN, SHOWN, 4, 4, 2


def shown(value: Any) -> str:
    """A value as a message shows it: its repr (true/false as YAML and JSON write them), cut to
    about SHOWN characters."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else _repr.repr(value)
    return text if len(text) <= SHOWN + 10 else text[:SHOWN] + "..."


_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "true or false", int: "a whole number",
          float: "a number", type(None): "null"}


def kind(value: Any) -> str:
    """'a list', 'a string', 'null', ...: what a value is, in a message."""
    if type(value) is bool:
        return "a boolean"
    for t, name in _KINDS.items():
        if type(value) is t:
            return name
    return f"a {type(value).__name__}"


def _names(types: Tuple[type, ...]) -> str:
    if float in types:  # an int is a number too
        types = tuple(t for t in types if t is not int)
    return " or ".join(dict.fromkeys(_KINDS.get(t, t.__name__) for t in types))


# --- bytes and text ---------------------------------------------------------------------------

def read_bytes(path: str, what: str = "") -> bytes:
    """The whole file. Missing, a directory, a FIFO or a device (never opened: a FIFO would block),
    unreadable, or past MAX_BYTES: BadInput naming it."""
    label = f"{what} {path}" if what else path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadInput(f"{label}: no such file") from None
    except OSError as e:
        raise BadInput(f"{label}: unreadable ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise BadInput(f"{label}: is a directory; expected a file")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{label}: not a regular file (a FIFO, socket or device); expected a file")
    if st.st_size > MAX_BYTES:
        raise BadInput(f"{label}: {st.st_size:,} bytes; expected at most {MAX_BYTES:,}")
    try:  # O_NONBLOCK: a FIFO swapped in since the stat does not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise BadInput(f"{label}: unreadable ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadInput(f"{label}: not a regular file; expected a file")
        try:
            return f.read()
        except OSError as e:
            raise BadInput(f"{label}: unreadable ({e.strerror})") from None


def decode(raw: bytes, label: str, expected: str) -> str:
    """UTF-8 text (a BOM dropped); else one line naming the first bad byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"{label}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                       f"expected {expected}") from None


def read_text(path: str, what: str = "", expected: str = "a text file") -> str:
    label = f"{what} {path}" if what else path
    return decode(read_bytes(path, what), label, expected)


def unpickle_refusal(e: BaseException) -> str:
    """What torch.load(weights_only=True)'s refusal says a file needed: 'it needs posix.system'."""
    m = re.search(r"GLOBAL ([\w.]+)", str(e))
    return f"it needs {m.group(1)}" if m else "it holds more than tensors and plain values"


# --- JSON -------------------------------------------------------------------------------------

def _top(value: Any, expect: Optional[type], label: str) -> Any:
    if expect is not None and not isinstance(value, expect):
        raise BadInput(f"{label}: expected {_KINDS.get(expect, expect.__name__)} at the top, got {kind(value)}")
    return value


def read_json(path: str, expect: Optional[type] = dict, what: str = "") -> Any:
    """A JSON file, its top level of type `expect` (an object by default)."""
    label = f"{what} {path}" if what else path
    text = read_text(path, what, "a JSON file")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise BadInput(f"{label}: not valid JSON ({getattr(e, 'msg', e)} at line {getattr(e, 'lineno', '?')} "
                       f"column {getattr(e, 'colno', '?')})") from None
    return _top(value, expect, label)


def read_jsonl(path: str, *, row: Optional[Dict[str, Any]] = None, optional: Optional[Dict[str, Any]] = None,
               cut_ok: bool = True,
               missing_ok: bool = False, what: str = "") -> List[Dict[str, Any]]:
    """The objects of a JSON-lines file, one per non-blank line, each checked against `row`
    ({key: types}, `need`; optional: keys checked where present). cut_ok: a last line without its newline that is not whole (a kill
    mid-write) is dropped. missing_ok: no file is no rows."""
    if missing_ok and not os.path.lexists(path):
        return []
    label = f"{what} {path}" if what else path
    text = read_text(path, what, "a JSON-lines file")
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            if cut_ok and i == len(lines):  # the unterminated last line: a write cut off
                break
            raise BadInput(f"{label} line {i}: not valid JSON ({getattr(e, 'msg', e)}): "
                           f"{shown(line)}; fix or remove that line") from None
        if not isinstance(value, dict):
            raise BadInput(f"{label} line {i}: expected a JSON object, got {kind(value)}: {shown(value)}")
        if row or optional:
            need(value, row or {}, f"{label} line {i}", optional)
        rows.append(value)
    return rows


# --- keys and their types ---------------------------------------------------------------------

def need(obj: Any, spec: Dict[str, Any], where: str, optional: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """obj (a dict) with every key of spec present and of its types: {key: type or tuple of types};
    None in a tuple allows null; a dict as the type: a nested object checked the same way.
    optional: keys checked only where present. Else BadInput: 'WHERE: 'KEY' is missing' or
    'WHERE: 'KEY' is a string ('x'); expected a number'."""
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: expected an object, got {kind(obj)}: {shown(obj)}")
    for key, types in [*spec.items(), *(optional or {}).items()]:
        if key not in obj:
            if key in spec:
                raise BadInput(f"{where}: '{key}' is missing")
            continue
        value = obj[key]
        if isinstance(types, dict) and isinstance(value, dict):
            need(value, types, f"{where}: '{key}'")
            continue
        if isinstance(types, dict):
            types = dict
        allowed = tuple(type(None) if t is None else t for t in (types if isinstance(types, tuple) else (types,)))
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            said = kind(value) if value is None else f"{kind(value)} ({shown(value)})"
            raise BadInput(f"{where}: '{key}' is {said}; expected {_names(allowed)}")
    return obj


def need_each(rows: Iterable[Dict[str, Any]], spec: Dict[str, Any], where: str) -> None:
    for i, r in enumerate(rows, 1):
        need(r, spec, f"{where} row {i}")


# --- YAML -------------------------------------------------------------------------------------

class Word(str):
    """A YAML 1.1 boolean word (yes, no, on, off, in any case PyYAML reads) as written: YAML 1.2
    and the user read `compile: off` as the string, YAML 1.1 as false. The config's type check
    (config.coerce) makes it a bool for a bool field, the word for a field that takes it, and
    refuses it, saying why, elsewhere."""

    @property
    def truth(self) -> bool:
        return self.lower() in ("yes", "on")


@functools.lru_cache(maxsize=None)
def _loader(words: bool):
    """yaml.SafeLoader, or with words a subclass that keeps YAML 1.1's yes/no/on/off as `Word`s.
    yaml is imported here, not with this module: the CLI's flags read Word, and `--help` needs no
    YAML parser."""
    import yaml

    if not words:
        return yaml.SafeLoader

    class Loader(yaml.SafeLoader):
        pass

    def bool_or_word(loader, node):
        value = loader.construct_scalar(node)
        return value.lower() == "true" if value.lower() in ("true", "false") else Word(value)

    Loader.add_constructor("tag:yaml.org,2002:bool", bool_or_word)
    return Loader


def plain(value: Any) -> Any:
    """value with every Word as the bool YAML 1.1 reads it (nested values: optimizer_args maps)."""
    if isinstance(value, Word):
        return value.truth
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def _expanded(node, memo: Dict[int, int]) -> int:
    """Nodes the document has once its aliases are expanded (an alias is its anchor's node again)."""
    import yaml
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = 1  # a recursive alias counts once, not forever
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded(v, memo) for v in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded(k, memo) + _expanded(v, memo) for k, v in node.value)
    else:
        n = 1
    memo[key] = min(n, MAX_YAML_NODES * 10)
    return memo[key]


def parse_yaml(text: str, label: str, *, words: bool = False) -> Any:
    """A YAML document from text: SafeLoader's values (Words kept where words=True), refused in
    one line when it is not YAML or its aliases expand past MAX_YAML_NODES."""
    import yaml
    loader = _loader(words)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        n = _expanded(node, {})
        if n > MAX_YAML_NODES:
            raise BadInput(f"{label}: its aliases expand to more than {MAX_YAML_NODES:,} values (an alias "
                           f"bomb?); expected a plain YAML file")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise BadInput(f"{label}: not valid YAML ({str(e).splitlines()[0][:200]})") from None
    except RecursionError:
        raise BadInput(f"{label}: nested too deeply; expected a plain YAML file") from None
    finally:
        loader.dispose()


def read_yaml(path: str, expect: Optional[type] = dict, what: str = "", *, words: bool = False) -> Any:
    """A YAML file, its top level of type `expect` (a mapping by default; an empty file is {})."""
    label = f"{what} {path}" if what else path
    value = parse_yaml(read_text(path, what, "a YAML file"), label, words=words)
    if value is None and expect is dict:
        return {}
    if isinstance(value, dict) and expect is dict and not all(isinstance(k, str) for k in value):
        bad = next(k for k in value if not isinstance(k, str))
        raise BadInput(f"{label}: the key {shown(bad)} is {kind(bad)}; expected a mapping of flag names to values "
                       f"(YAML reads an unquoted yes/no/on/off key as a boolean: quote it)")
    return _top(value, expect, label)


# --- a run directory --------------------------------------------------------------------------

METRICS_ROW = {"step": int, "time_s": NUMBER, "loss": NUMBER + (None,)}
"""What readers take from a metrics.jsonl row (runs.RunDir.log_metrics writes it)."""
EVAL_ROW = {"time_s": NUMBER}
EVAL_OPTIONAL = {"step": int, "samples": NUMBER, "test_loss": NUMBER + (None,), "test_accuracy": NUMBER + (None,),
                 "val_loss": NUMBER + (None,)}
"""What readers take from an eval.jsonl row (runs.RunDir.log_eval writes it)."""
SUMMARY = {"status": str}
"""What every reader of summary.json needs; a completed run's readers need `RESULT` too."""
OPT_NUMBER = NUMBER + (None,)
SUMMARY_NUMBERS = {k: OPT_NUMBER for k in ("loss_area", "min_loss", "final_loss", "test_accuracy", "test_loss",
                                           "best_test_accuracy", "wall_time_s", "samples_per_s")}
"""summary.json's numbers that readers compare (winners, reports): where present, a number or null."""
RESULT_ROW = {"id": str, "status": str, "config": {"workers": int, "batch_size": int, "lr": NUMBER},
              "summary": dict}
"""A line of a sweep's results.jsonl (trials.TrialRunner.record writes it)."""
SWEEP_SPEC = {"trials": list}
SWEEP_SPEC_OPTIONAL = {"threshold": NUMBER, "target_accuracy": OPT_NUMBER, "axis_order": (list, None),
                       "winner_metric": (str, None), "winner_goal": (str, None), "slots": (int, None)}
"""A sweep's sweep.json (trials.TrialRunner writes it): what the report and advise read."""
RESULT = {"workers": int, "batch_size": int, "lr": NUMBER, "steps": int, "wall_time_s": NUMBER}
"""A finished run's numbers, as the sweep's winners and advise read them."""


def result_row(row: Any, where: str) -> Dict[str, Any]:
    """A results.jsonl row checked: RESULT_ROW's keys and its summary's numbers."""
    need(row, RESULT_ROW, where)
    need(row["summary"], {}, f"{where}: 'summary'", optional=SUMMARY_NUMBERS)
    return row


def sweep_spec(sweep_dir: str, *, missing_ok: bool = True) -> Dict[str, Any]:
    """SWEEP/sweep.json checked (SWEEP_SPEC); {} when missing_ok and absent."""
    path = os.path.join(sweep_dir, "sweep.json")
    if missing_ok and not os.path.lexists(path):
        return {}
    spec = need(read_json(path), SWEEP_SPEC, path, optional=SWEEP_SPEC_OPTIONAL)
    bad = next((t for t in spec["trials"] if not isinstance(t, str)), None)
    if bad is not None:
        raise BadInput(f"{path}: 'trials' holds {kind(bad)} ({shown(bad)}); expected trial ids (strings)")
    return spec


def run_summary(run_dir: str, *, missing_ok: bool = False, spec: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """RUN/summary.json: an object with SUMMARY's keys (and spec's); {} when missing_ok and absent."""
    path = os.path.join(run_dir, "summary.json")
    if missing_ok and not os.path.lexists(path):
        return {}
    return need(read_json(path), {**SUMMARY, **(spec or {})}, path, optional=SUMMARY_NUMBERS)


def run_config(run_dir: str, *, missing_ok: bool = False) -> Dict[str, Any]:
    """RUN/config.yaml: a mapping of config keys; {} when missing_ok and absent."""
    path = os.path.join(run_dir, "config.yaml")
    if missing_ok and not os.path.lexists(path):
        return {}
    return read_yaml(path)


def run_metrics(run_dir: str, *, missing_ok: bool = False) -> List[Dict[str, Any]]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"), row=METRICS_ROW, missing_ok=missing_ok)


def run_evals(run_dir: str, *, missing_ok: bool = True) -> List[Dict[str, Any]]:
    return read_jsonl(os.path.join(run_dir, "eval.jsonl"), row=EVAL_ROW, optional=EVAL_OPTIONAL,
                      missing_ok=missing_ok)


ENDED = ("completed", "diverged")
"""A run's statuses that --resume does not continue."""


def resume_check(run_dir: str) -> Optional[Dict[str, Any]]:
    """What --resume reads of RUN before anything in it is touched: the summary of a run that
    ended (ENDED: nothing to continue, nothing rewritten), else None once every file a resume
    keeps reads back whole: summary.json (if any), config.yaml, metrics.jsonl and eval.jsonl. A
    resume rewrites config.yaml and cuts the logs back to the checkpoint's step, so a damaged one
    is refused here (BadInput naming it), as the user left it, never rewritten around the damage."""
    summary = run_summary(run_dir, missing_ok=True)
    if summary.get("status") in ENDED:
        return summary
    run_config(run_dir, missing_ok=True)
    run_metrics(run_dir, missing_ok=True)
    run_evals(run_dir)
    return None
