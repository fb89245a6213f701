"""A sweep flag's values ('A,B,C', 'START:STOP:STEP', a mix, a YAML scalar or list) as the values
of one option of a known kind: plain data, no torch, so that the CLI refuses a malformed list from
its flag table before torch's import (sweeps/cli.py) with the line the grid gives (grid.py)."""
from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any, List

from shmlearn.config.flags import BOOL_WORDS
from shmlearn.errors import BadInput

MAX_TRIALS = 100_000


def number(name: str, text: str, kind: type):
    try:
        d = Decimal(text)
    except InvalidOperation:
        raise BadInput(f"--{name.replace('_', '-')} {text}: expected a number") from None
    if not d.is_finite():
        raise BadInput(f"--{name.replace('_', '-')} {text}: expected a finite number")
    if kind is int and d != d.to_integral_value():
        raise BadInput(f"--{name.replace('_', '-')} {text}: expected a whole number")
    return d


def value_range(name: str, item: str, kind: type) -> List[Any]:
    """A:B:STEP, both ends included when STEP lands on B. Decimal arithmetic, so 0.1:0.9:0.1 is
    exactly the nine values 0.1 ... 0.9 (float steps would give 0.30000000000000004 and may
    drop 0.9)."""
    flag = f"--{name.replace('_', '-')} {item}"
    parts = item.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 2 and kind is not int):
        raise BadInput(f"{flag}: expected a range START:STOP:STEP" + (" or START:STOP" if kind is int else ""))
    a, b = number(name, parts[0], kind), number(name, parts[1], kind)
    step = number(name, parts[2], kind) if len(parts) == 3 else Decimal(1)
    if step == 0 or (b - a) * step < 0:
        raise BadInput(f"{flag}: the step must be nonzero and go from {parts[0]} toward {parts[1]}")
    n = int((b - a) / step) + 1
    if n > MAX_TRIALS:
        raise BadInput(f"{flag}: {n} values; at most {MAX_TRIALS}")
    return [kind(a + i * step) for i in range(n)]


def parse_values(name: str, raw: Any, kind: type) -> List[Any]:
    """The values of one flag of this kind (bool, int, float or str): 'A,B,C', a range
    'START:STOP:STEP' (numbers only), a mix of both ('16,64:256:64'), or a YAML scalar or list.
    Duplicates are dropped, order is kept."""
    items = raw if isinstance(raw, list) else [raw]
    values: List[Any] = []
    for item in items:
        if isinstance(item, (list, dict, tuple, set)):  # every field is one scalar: a value may not nest
            what = "a mapping" if isinstance(item, dict) else "a list"
            raise BadInput(f"--{name.replace('_', '-')}: {raw!r} holds {what} ({item!r}); expected one value "
                           f"or a list of values")
        if not isinstance(item, str):
            values.append(item)
            continue
        for part in (p.strip() for p in item.split(",")):
            if part == "":
                raise BadInput(f"--{name.replace('_', '-')} {item}: empty value in the list")
            if part.lower() in ("none", "null"):
                values.append(None)
            elif kind is bool:
                if part.lower() not in ("1", "0", *BOOL_WORDS):
                    raise BadInput(f"--{name.replace('_', '-')} {part}: expected true or false")
                values.append(part.lower() == "1" or BOOL_WORDS.get(part.lower(), False))
            elif kind in (int, float) and ":" in part:
                values.extend(value_range(name, part, kind))
            elif kind in (int, float):
                values.append(kind(number(name, part, kind)))
            else:
                values.append(part)
    seen, out = set(), []
    for v in values:
        if (type(v), v) not in seen:
            seen.add((type(v), v))
            out.append(v)
    return out
