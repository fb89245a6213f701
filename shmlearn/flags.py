"""Flag help and types read from the config dataclasses: one source for the code and for --help.
Used by the train flags (cli.py) and the sweep's flags (sweep_cli.py), and by sweep.py to parse
a value by its field's type."""
from __future__ import annotations

import ast
import inspect
import typing
from typing import Dict

from shmlearn.data import DATASETS


def field_docs(cls) -> Dict[str, str]:
    """The docstring under each dataclass field: one source for the code and for --help."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def flag_docs(cls=None) -> Dict[str, str]:
    """--help per field of `cls` (default TrainConfig): its docstring, and for --model and
    --dataset the names registered now (the registries, not a copy of them in a docstring)."""
    # Imported here: they import torch, and the CLI refuses bad input before torch loads
    # (cli.precheck); this module is imported by cli.py at its top.
    from shmlearn.config import TrainConfig  # lazy: torch, after the CLI's cheap checks
    cls = cls or TrainConfig
    docs = field_docs(cls)
    if cls is TrainConfig:
        from shmlearn.models import MODELS  # lazy: torch, after the CLI's cheap checks
        from shmlearn.sync import registry  # lazy: torch, after the CLI's cheap checks
        docs["model"] += f" Built in: {', '.join(MODELS)}."
        docs["dataset"] += f" Built in: {', '.join(DATASETS)}."
        docs["strategy"] += " " + "; ".join(f"{n}: {e.help}" for n, e in registry.entries().items()) + "."
    return docs


def scalar_type(hint) -> type:
    """bool, int, float or str from a field's type (Optional[X] is X): from the typing objects
    themselves, not from their spelling."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    return base if base in (bool, int, float) else str
