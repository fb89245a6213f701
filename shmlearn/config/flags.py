"""Options read from typed dataclasses: one source for the code, its validation and the flags.

An Option is one setting as the command line sees it: its name (the config key; `avg_period` is
`--avg-period`), its resolved type, default, help (the docstring under the field) and, for a
`Literal[...]` type, its choices. TrainConfig's settings (config.options) and each strategy's
parameters (sync/registry.py) are read into Options; the train flags (cli.py), the sweep's flags
(sweeps/cli.py), the sweep's value parsing (sweeps/grid.py) and config.validate read them. This
module imports nothing of shmlearn but its errors, so everything above can read it.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import inspect
import json
import os
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shmlearn.errors import BadInput
from shmlearn.record.readback import Word, kind, shown


@functools.lru_cache(maxsize=None)
def _docs_of(cls) -> Dict[str, str]:
    """The docstrings under the fields written in `cls`'s own body (not its bases')."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a class made at run time): no help to show
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def field_docs(cls) -> Dict[str, str]:
    """The docstring under each dataclass field, the bases' fields included (TrainConfig's are
    written in its base): one source for the code and for --help."""
    docs: Dict[str, str] = {}
    for c in reversed(cls.__mro__):
        if "__dataclass_fields__" in vars(c):
            docs.update(_docs_of(c))
    return docs


def _unwrap(hint):
    """Optional[X] is X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def literal_choices(hint) -> Optional[Tuple[Any, ...]]:
    """The values of a Literal[...] type (Optional[Literal[...]] too), else None."""
    base = _unwrap(hint)
    return typing.get_args(base) if typing.get_origin(base) is typing.Literal else None


def scalar_type(hint) -> type:
    """bool, int, float or str from a field's type (Optional[X] is X; Literal[...] is its values'
    type): from the typing objects themselves, not from their spelling."""
    choices = literal_choices(hint)
    base = type(choices[0]) if choices else _unwrap(hint)
    return base if base in (bool, int, float) else str


def choice_error(flag: str, value: Any, choices) -> str:
    """The one line a value outside a field's choices gets, from validate and argparse alike."""
    names = [str(c) for c in choices]
    said = f"{names[0]} or {names[1]}" if len(names) == 2 else "one of " + ", ".join(names)
    return f"{flag} {value}: choose {said}"


@dataclass(frozen=True)
class Option:
    """One setting of a typed config, as its flag and its validation see it."""

    name: str
    """The config key (YAML, TrainConfig keyword); the flag is it with dashes."""
    type: Any
    """The resolved annotation (typing.get_type_hints)."""
    default: Any
    help: str = ""
    strategies: Tuple[str, ...] = ()
    """A strategy's parameter: the strategies that take it (--help groups it under them)."""
    choices: Optional[Tuple[Any, ...]] = None
    """The allowed values: the Literal's, or given (--strategy: the registry's names)."""
    group: str = ""
    """Where --help lists it (config.HELP_GROUPS: "basics", "GPU kernels"); "" the general flags."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def kind(self) -> type:
        return scalar_type(self.type)

    def check(self, value: Any) -> None:
        """BadInput (one line naming the flag) if the value is not one of the choices; None
        passes where the type is Optional (the default: decided later)."""
        optional = _unwrap(self.type) is not self.type
        if self.choices is None or value in self.choices or (value is None and optional):
            return
        raise BadInput(choice_error(self.flag, value, self.choices))

    def coerce(self, value: Any, source: str = "", *, strict: bool = False) -> Any:
        """value as this option's declared type takes it, or BadInput in one line naming the
        source (a file), the option, the value and the type expected. What a YAML file means is
        read as meant (docs/reliability.md, "Reading back"): YAML 1.1's unquoted yes/no/on/off
        (a readback.Word) are true/false for a bool, the word itself where it is one of a
        Literal's choices (`compile: off`), and refused saying why elsewhere; a quoted "yes" or
        "off" for a bool is that bool; a number YAML 1.1 left as text (1e-3) is that number.
        strict: none of that (a value from Python must already be of the type)."""
        hint = self.type
        if isinstance(value, Word):
            if accepts(hint, value.truth) and not accepts(hint, str(value)):
                return value.truth
            if self.choices is not None and str(value) in self.choices:
                return str(value)
            quote = f"; quote it ({self.name}: \"{value}\")" if accepts(hint, "x") else ""
            raise BadInput(f"{_at(source, self.name)} {value}: YAML 1.1 reads the unquoted word {value} as the "
                           f"boolean {str(value.truth).lower()}; expected {describe(hint)}{quote}")
        elif isinstance(value, str) and not accepts(hint, value) and not strict:
            if accepts(hint, True) and value.strip().lower() in BOOL_WORDS:
                return BOOL_WORDS[value.strip().lower()]
            if accepts(hint, 0.5):
                try:
                    return float(value)  # a non-finite one is validate's to refuse, naming its range
                except ValueError:
                    pass
        if accepts(hint, value) or (self.choices is not None and type(value) is str):
            return value  # a string outside a Literal's choices: `check`'s line names them
        said, why = f"{shown(value)} is {kind(value)}", ""
        if isinstance(value, (datetime.date, datetime.datetime)) and accepts(hint, "x"):
            said, why = f"{value} is a date", " (YAML reads an unquoted date as one: quote it)"
        elif isinstance(value, bool) and accepts(hint, "x"):
            said, why = f"{str(value).lower()} is a boolean", " (YAML reads an unquoted true/false as one: quote it)"
        raise BadInput(f"{_at(source, self.name)} {said}; expected {describe(hint)}{why}")


BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
"""A bool's words, as YAML 1.1 reads them unquoted: quoted, they mean the same to a bool field."""


def _at(source: str, name: str) -> str:
    """'--config FILE: out' (a file's key) or '--out' (a flag, or a value from Python)."""
    return f"{source}: {name}" if source else "--" + name.replace("_", "-")


def accepts(hint, value: Any) -> bool:
    """Whether `value` is of the resolved annotation `hint`: Any, Optional/Union, Literal, bool,
    int (not a bool), float (an int or float, not a bool, NaN included: ranges are validate's),
    str, Dict/dict, List/Tuple. A Word is not a str here: it must be read first (Option.coerce)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if origin is typing.Union:
        return any(accepts(a, value) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return any(type(value) is type(c) and value == c for c in typing.get_args(hint))
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str) and not isinstance(value, Word)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if origin in (list, tuple) or hint in (list, tuple):
        return isinstance(value, (list, tuple))
    return isinstance(hint, type) and isinstance(value, hint)


def describe(hint) -> str:
    """A type as a message says it: 'a string', 'a whole number or null', 'one of on, off'."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        parts = [describe(a) for a in typing.get_args(hint) if a is not type(None)]
        null = type(None) in typing.get_args(hint)
        return " or ".join(parts) + (" or null" if null else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if origin is dict or hint is dict:
        return "a mapping"
    return "a list" if origin in (list, tuple) else getattr(hint, "__name__", str(hint))


def help_group(parser, option: Option, made: Dict[tuple, Any]):
    """Where a flag goes in --help: a strategy's parameter in the argument group of the
    strategies that take it ("--strategy ps"), made once per set of strategies in `made`; one of
    a named group (Option.group) in that group; the others in `parser` itself."""
    if option.group and not option.strategies:
        if option.group not in made:
            made[option.group] = parser.add_argument_group(option.group)
        return made[option.group]
    if not option.strategies:
        return parser
    if option.strategies not in made:
        made[option.strategies] = parser.add_argument_group(f"--strategy {' or '.join(option.strategies)}")
    return made[option.strategies]


def options_of(cls, *, names: Optional[Dict[str, str]] = None, strategies: Tuple[str, ...] = ()) -> List[Option]:
    """An Option per field of the dataclass `cls`, in order. names: field -> the option's name
    (a strategy's parameter `period` is the config's `avg_period`); default: the field's own."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(Option(name=(names or {}).get(f.name, f.name), type=hints[f.name], default=default,
                          help=docs.get(f.name, ""), strategies=strategies, choices=literal_choices(hints[f.name])))
    return out


@dataclass(kw_only=True)
class Section:
    """A config section: a keyword-only dataclass of settings declared beside the code that reads
    them (StepOptions in step/options.py, DataOptions in data/options.py, ...), each field with
    its docstring (its --help). TrainConfig is composed of them (config/train_config.py). A
    field typed Literal[...] is checked against its choices once, here, when the section is
    made (BadInput naming the flag), whether it is made alone (StepOptions for the bench) or as
    part of a TrainConfig; the code that reads the value checks it no more."""

    def __post_init__(self) -> None:
        for option in _choice_options(type(self)):
            option.check(getattr(self, option.name))


@functools.lru_cache(maxsize=None)
def _choice_options(cls) -> Tuple[Option, ...]:
    """The Literal fields of the Section classes `cls` is made of (once per class: the type hints
    cost ~1 ms). Fields of other bases (the strategies' parameters) are checked by their owner."""
    own = {name for c in cls.__mro__ if issubclass(c, Section) and "__dataclass_fields__" in vars(c)
           for name in vars(c).get("__annotations__", {})}
    return tuple(o for o in options_of(cls) if o.name in own and o.choices is not None)


# --- the flag table: the train flags without importing torch --------------------------------------
# config.options() imports the modules that own the choices (models, nn, step, every strategy),
# which import torch (~2-6 s): `shmlearn train --help` or a misspelled flag waited for it (issue 53).
# What the parser needs of each option is plain data; it is kept in the user's cache, keyed by a
# digest of the sources it was read from, written by any process that read the options live.

TABLE_PREFIX = "flags-"
KEEP_TABLES = 8
"""Tables kept for other sources (other checkouts, installs, edits) beside the newest; older ones go."""


def cache_dir() -> str:
    """shmlearn's cache folder: $SHMLEARN_CACHE_DIR, else $XDG_CACHE_HOME/shmlearn, else
    ~/.cache/shmlearn."""
    own = os.environ.get("SHMLEARN_CACHE_DIR")
    if own:
        return own
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shmlearn")


def _source_files() -> List[str]:
    """Every .py file the options can come from: the package, and the strategy folders of
    SHMLEARN_STRATEGY_PATH (shmlearn/sync/__init__.py imports their files too)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # shmlearn/
    roots = [package] + [os.path.abspath(d) for d in os.environ.get("SHMLEARN_STRATEGY_PATH", "").split(os.pathsep) if d]
    out = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return out


def source_digest() -> str:
    """sha256 over the sources' paths and bytes (~2 MB read, a few ms): any edit, added or removed
    file (a new strategy) makes another table."""
    h = hashlib.sha256()
    for path in _source_files():
        h.update(path.encode() + b"\0")
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError:  # removed while walking: the digest differs from any table's anyway
            h.update(b"\1")
    return h.hexdigest()


_KINDS = {"bool": bool, "int": int, "float": float, "str": str}


def _row(o: Option) -> Dict[str, Any]:
    optional = _unwrap(o.type) is not o.type
    return {"name": o.name, "kind": o.kind.__name__, "optional": optional, "default": o.default,
            "help": o.help, "strategies": list(o.strategies),
            "choices": None if o.choices is None else list(o.choices), "group": o.group}


def _option(row: Dict[str, Any]) -> Option:
    kind = _KINDS[row["kind"]]
    return Option(name=row["name"], type=Optional[kind] if row["optional"] else kind, default=row["default"],
                  help=row["help"], strategies=tuple(row["strategies"]),
                  choices=None if row["choices"] is None else tuple(row["choices"]), group=row["group"])


def _table_path(digest: str, prefix: str = TABLE_PREFIX) -> str:
    return os.path.join(cache_dir(), f"{prefix}{digest}.json")


def read_kept(prefix: str) -> Any:
    """The JSON kept under `prefix` for these sources (keep); None where there is none or it is
    unreadable (the caller reads live again and keeps it)."""
    try:
        with open(_table_path(source_digest(), prefix), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def keep(prefix: str, data: Any) -> None:
    """Keep `data` (plain JSON, read live from modules that import torch) for the next parser of
    these sources, under `prefix` (the flag table's, or another one: the strategies' names that
    `bench` and `simulate` list); of the files of other sources (other checkouts, an edited tree,
    an older install) the KEEP_TABLES newest stay. A cache that cannot be written (a read-only
    home) only leaves the next parser to read live again."""
    try:
        text = json.dumps(data)
    except (TypeError, ValueError):  # a default JSON cannot hold: read live every time
        return
    path = _table_path(source_digest(), prefix)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: a parser reading at the same time sees all or nothing
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return
    with contextlib.suppress(OSError):
        folder = os.path.dirname(path)
        tables = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".json")]
        for old in sorted(tables, key=os.path.getmtime, reverse=True)[KEEP_TABLES:]:
            os.remove(old)


def read_table() -> Optional[List[Option]]:
    """The options as the table for these sources has them; None where there is none (or it is
    unreadable: it is rebuilt from the live options)."""
    try:
        return [_option(r) for r in read_kept(TABLE_PREFIX)]
    except (ValueError, TypeError, KeyError):
        return None


def write_table(options: Sequence[Option]) -> None:
    """Keep `options` (read live) for the next parser of these sources (keep)."""
    keep(TABLE_PREFIX, [_row(o) for o in options])
