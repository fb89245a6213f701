"""A --config value of the wrong type (issue 53), per field and per wrong type: one line naming
the field (as the YAML key or its --flag), exit 2, before any worker starts. YAML 1.1's words
(`off`, `on`) are read as the user meant, or refused saying why; an alias bomb is refused in a
line of bounded length."""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, List

import yaml

from benchmarks.faults import registry
from benchmarks.faults.core import Cmd
from benchmarks.faults.registry import out_of, write

case = functools.partial(registry.case, klass="yamltypes")
BASE = {"dataset": "digits", "model": "softmax", "samples": "1024", "workers": "1", "eval_points": "1"}
"""A run of ~32 steps: what a case costs if the value is taken where it should have been refused."""

WRONG = {"int": "5", "list": "[a, b]", "date": "2024-01-01", "dict": "{a: 1}", "string": "abc", "bool": "true",
         "quoted-yes": '"yes"', "float": "0.5"}
"""YAML text of each wrong type (a date is a datetime.date to PyYAML)."""
FIELDS = [  # (field, the wrong types tried)
    *((f, ("int", "list", "date")) for f in ("init", "optimizer", "augment", "data_dir", "model", "dataset", "loss",
                                            "monitor", "strategy", "lr_schedule")),
    ("out", ("int", "list", "date", "dict")),
    *((f, ("string", "list", "bool")) for f in ("lr", "batch_size", "samples", "epochs", "workers", "seed",
                                               "timeout", "momentum")),
    *((f, ("quoted-yes", "int", "list")) for f in ("noise_scale", "tensorboard", "save_best", "save_model")),
]


def config_text(values: Dict[str, str]) -> str:
    return "".join(f"{k}: {v}\n" for k, v in {**BASE, **values}.items())


def names(field: str) -> List[str]:
    return [field, "--" + field.replace("_", "-")]


def _names_field(field: str):
    def verify(res: Dict[str, Any]) -> List[str]:
        if any(n in res["stderr"] for n in names(field)):
            return []
        return [f"stderr names neither {' nor '.join(names(field))}"]
    return verify


def train_cmd(t: str, values: Dict[str, str], expect: Any = 2, verify=None) -> Cmd:
    path = write(out_of(t, "config.yaml"), config_text(values))
    out = [] if "out" in values else ["--out", out_of(t)]
    return Cmd(["train", "--config", path, "--no-progress", *out], expect, verify=verify, limit=120)


def _read_as_true(t: str, field: str):
    """A quoted "yes" for a bool is read as the user meant (config.flags.Option.coerce): the run's
    config.yaml records true."""
    def verify(res: Dict[str, Any]) -> List[str]:
        try:
            with open(os.path.join(out_of(t), "config.yaml")) as f:
                got = yaml.safe_load(f).get(field)
        except (OSError, AttributeError, yaml.YAMLError) as e:
            return [f"config.yaml unreadable: {e}"]
        return [] if got is True else [f"config.yaml has {field}: {got!r}, expected true"]
    return verify


def _wrong_type(t: str, field: str, ty: str) -> List[Cmd]:
    if ty == "quoted-yes":
        return [train_cmd(t, {field: WRONG[ty]}, 0, verify=_read_as_true(t, field))]
    return [train_cmd(t, {field: WRONG[ty]}, verify=_names_field(field))]


for _field, _types in FIELDS:
    for _ty in _types:
        case(f"yaml-{_field}-{_ty}", "53", f"train --config with {_field}: {WRONG[_ty]}" +
             (" (read as true, as meant)" if _ty == "quoted-yes" else ""))(
            lambda t, f=_field, ty=_ty: _wrong_type(t, f, ty))


def _said_why(word: str):
    """Taken (exit 0), or refused saying that YAML read the word as a boolean."""
    def verify(res: Dict[str, Any]) -> List[str]:
        if res["exit"] != 2:
            return []
        low = res["stderr"].lower()
        return [] if any(w in low for w in ("yaml", "quote", "boolean")) else \
            [f"refused {word} without saying YAML read it as a boolean"]
    return verify


for _field, _word in (("compile", "off"), ("eval_at_start", "off"), ("cudnn_benchmark", "off"), ("conv_pool", "off"),
                      ("combo_kernels", "on")):
    case(f"yaml-{_field}-bare-{_word}", "53", f"train --config with {_field}: {_word} (YAML 1.1: a boolean)")(
        lambda t, f=_field, w=_word: [train_cmd(t, {f: w}, {0, 2}, verify=_said_why(w))])


def bomb(levels: int = 7) -> str:
    """A billion laughs under one field: 9**levels strings by reference, tens of MB when printed."""
    rows = ["  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        prev, name = chr(ord("a") + i - 1), chr(ord("a") + i)
        rows.append(f"  - &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n" + "\n".join(rows)


def _short(limit: int = 2000):
    def verify(res: Dict[str, Any]) -> List[str]:
        return [] if res["stderr_bytes"] <= limit else [f"stderr is {res['stderr_bytes']} bytes (at most {limit})"]
    return verify


@case("yaml-alias-bomb-train", "53", "train --config whose lr is a YAML alias bomb (it printed 58 MB)")
def _(t):
    return [train_cmd(t, {"lr": bomb()}, 2, verify=_short())]


@case("yaml-alias-bomb-sweep", "53", "sweep --config whose lr is a YAML alias bomb")
def _(t):
    path = write(out_of(t, "sweep.yaml"), config_text({"lr": bomb()}))
    return [Cmd(["sweep", "--config", path, "--no-report", "--no-progress", "--out", out_of(t, "s")], 2,
                verify=_short(), limit=120)]


@case("yaml-top-level-list", "53", "train --config holding a list, not a mapping")
def _(t):
    path = write(out_of(t, "config.yaml"), "- lr: 0.1\n- workers: 2\n")
    return [Cmd(["train", "--config", path, "--no-progress", "--out", out_of(t)], 2, says=["config.yaml"])]


@case("yaml-unknown-key", "53", "train --config with a misspelled key (learning_rate)")
def _(t):
    return [train_cmd(t, {"learning_rate": "0.1"}, 2, verify=_names_field("learning_rate"))]


SWEEP_WRONG = [("workers", "two"), ("lr", "[0.1, abc]"), ("batch_size", "{a: 1}"), ("samples", "[1024, [2048]]"),
               ("out", "[1, 2]")]
for _field, _value in SWEEP_WRONG:
    @case(f"yaml-sweep-{_field}", "53", f"sweep --config with {_field}: {_value}")
    def _(t, f=_field, v=_value):
        path = write(out_of(t, "sweep.yaml"), config_text({f: v, **({} if f == "lr" else {"lr": "[0.1, 0.2]"})}))
        out = [] if f == "out" else ["--out", out_of(t, "s")]
        return [Cmd(["sweep", "--config", path, "--no-report", "--no-progress", *out], 2, verify=_names_field(f),
                    limit=120)]


@case("yaml-save_model-quoted-no", "53", 'train --config with save_model: "no" (a truthy string: it saved the model)')
def _(t):
    def verify(res: Dict[str, Any]) -> List[str]:
        saved = [n for n in ("model.pt", "model.safetensors") if os.path.exists(os.path.join(out_of(t), n))]
        return [f"saved {', '.join(saved)} although save_model is \"no\""] if saved else []
    return [train_cmd(t, {"save_model": '"no"'}, 0, verify=verify)]
