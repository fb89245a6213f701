"""The strategy registry: each strategy's file registers one Entry that describes it (docs/architecture.md,
"How to add a strategy"). Config validation, train, fast, sweep, bench and simulate
ask an Entry (or a Spec: an Entry with its parameters) instead of naming strategies.

An Entry holds:
* `params`: a dataclass of the strategy's parameters, declared beside its code with `param`:
  each field's type (a `Literal[...]` gives its choices), default, docstring (its --help) and
  the config key that sets it (`param("avg_period", 1)` is TrainConfig's `avg_period`, YAML's
  `avg_period:` and `--avg-period`). TrainConfig's sync section (`section`) has every
  registered strategy's keys as fields: a strategy's parameter needs no edit to config/. A
  parameter's value check lives in its `__post_init__` (BadInput naming the flag); `servers` (a
  property, default 0) is how many ranks only serve.
* the layout: W workers need W + servers processes; ranks 0..servers-1 serve, rank r >= servers
  computes on shard r - servers (Spec.processes, compute_ranks, shard).
* capabilities: `fast_step` (the strategy implements gated_step, fast.py) and `rounds` (it
  communicates once per `period(params)` steps: weight averaging).
* `summary`: what it adds to summary.json besides `strategy_params` (the parameters as a dict).
* `cost`: its cost model for simulate, f(Costs, params) -> {part: seconds per step}, and
  `variants`: the names simulate predicts it under, each with fixed parameters
  ({"ps-dedicated": {"dedicated": True}}).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from shmlearn.errors import BadInput
from shmlearn.config.flags import Option, options_of


@dataclass(frozen=True)
class NoParams:
    """A strategy without parameters."""

    @property
    def servers(self) -> int:
        return 0


@dataclass(frozen=True)
class Costs:
    """What simulate measured or fitted, for one strategy's cost model at W computing workers
    (simulate.py's docstring has the model). Collective times are functions of (ranks, bytes)."""

    workers: int
    """W, the computing workers."""
    processes: int
    """W + the strategy's servers."""
    grad_bytes: float
    """S = 4 x parameters: one gradient or one copy of the weights."""
    local: Dict[str, float]
    """data, compute, update, other of one worker while W workers compute (seconds)."""
    update_s: float
    """One optimizer update with nothing else running (a server's)."""
    all_reduce: Callable[[float, float], float]
    gather: Callable[[float, float], float]
    broadcast: Callable[[float, float], float]
    average: Callable[[int, float], float]
    """(rows, bytes) -> seconds: a server's mean of `rows` gradients."""
    wake: Callable[[str], float]
    """op -> the extra cost of a step's first collective after compute (0 without a measurement)."""
    bwd_frac: float
    """The share of compute that is backward (what overlapped communication can hide behind)."""


def _zero(costs: Costs, params) -> Dict[str, float]:
    return {}


@dataclass(frozen=True)
class Entry:
    name: str
    cls: type
    """The SyncStrategy subclass; built with rank, world_size, group and the params' fields."""
    help: str
    """One line for --help and error messages."""
    params: type = NoParams
    rounds: bool = False
    """Communicates once per `period(params)` steps (weight averaging), not every step."""
    period: Callable[[Any], int] = lambda params: 1
    summary: Callable[[Any], Dict[str, Any]] = lambda strategy: {}
    """summary.json fields from the finished strategy, besides strategy_params."""
    cost: Callable[[Costs, Any], Dict[str, float]] = _zero
    variants: Optional[Mapping[str, Mapping[str, Any]]] = None
    """simulate's names for this strategy with fixed parameters; default {name: {}}."""
    check: Callable[[Any], None] = lambda cfg: None
    """Refuses (BadInput) the rest of a TrainConfig this strategy cannot run with."""
    predict_more: Optional[Callable[..., Dict[str, Any]]] = None
    """simulate's predictions besides seconds per step, f(Costs, params, slow=(rank, k) or None)
    -> dict (async-ps: each worker's staleness histogram)."""

    @property
    def fast_step(self) -> bool:
        return bool(self.cls.gated)

    @property
    def sim_variants(self) -> Mapping[str, Mapping[str, Any]]:
        return self.variants if self.variants is not None else {self.name: {}}

    def config_fields(self) -> Dict[str, str]:
        """{config key: parameter} for each parameter."""
        return {f.metadata["config"]: f.name for f in fields(self.params)}

    def options(self) -> Tuple[Option, ...]:
        """Its parameters as config options: named by their config keys, typed, documented."""
        return _entry_options(self.name, self.params)

    def params_from(self, values: Mapping[str, Any]) -> Any:
        """The parameters from TrainConfig-named values (a config's dict, an old summary's keys);
        missing ones take their defaults. BadInput if a value is out of range or not one of a
        Literal's choices."""
        for o in self.options():
            if o.name in values:
                o.check(values[o.name])
        return self.params(**{p: values[c] for c, p in self.config_fields().items() if c in values})

    def params_of(self, d: Mapping[str, Any]) -> Any:
        """The parameters from summary.json's `strategy_params`."""
        known = {f.name for f in fields(self.params)}
        return self.params(**{k: v for k, v in d.items() if k in known})

    def spec(self, params=None) -> "Spec":
        return Spec(self, params if params is not None else self.params())


@dataclass(frozen=True)
class Spec:
    """A strategy with its parameters: the layout of a run and how to build each rank's strategy."""

    entry: Entry
    params: Any

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def servers(self) -> int:
        """Ranks 0..servers-1 only serve; the rest compute."""
        return self.params.servers

    def processes(self, workers: int) -> int:
        return workers + self.servers

    def compute_ranks(self, world_size: int) -> int:
        return world_size - self.servers

    def shard(self, rank: int) -> Optional[int]:
        """The data shard rank `rank` trains on, of compute_ranks; None for a server."""
        return rank - self.servers if rank >= self.servers else None

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self.params)

    def flags(self) -> str:
        """The command line that chose this: '--strategy ps --ps-dedicated'."""
        out = [f"--strategy {self.name}"]
        defaults = self.entry.params()
        for f in fields(self.params):
            v = getattr(self.params, f.name)
            if v != getattr(defaults, f.name):
                flag = "--" + f.metadata["config"].replace("_", "-")
                out.append(flag if v is True else f"{flag} {v}")
        return " ".join(out)

    def build(self, *, rank: int, world_size: int, group=None):
        return self.entry.cls(rank=rank, world_size=world_size, group=group, **self.as_dict())

    def summary(self, strategy) -> Dict[str, Any]:
        """What this strategy adds to summary.json: strategy_params, and the entry's own fields."""
        return {"strategy_params": self.as_dict(), **self.entry.summary(strategy)}

    def period(self) -> int:
        """Steps per communication round (1: every step communicates)."""
        return self.entry.period(self.params)


_ENTRIES: Dict[str, Entry] = {}


@functools.lru_cache(maxsize=None)
def _entry_options(name: str, params: type) -> Tuple[Option, ...]:
    # Cached: TrainConfig asks on every keyword it is given, and the help is read from source.
    return tuple(options_of(params, names={f.name: f.metadata["config"] for f in fields(params)},
                            strategies=(name,)))


def register(entry: Entry) -> Entry:
    if _COMPOSED and fields(entry.params):
        raise TypeError(f"strategy {entry.name}: registered after TrainConfig was composed (shmlearn.config "
                        f"imported), so its parameters could not be set; put its file in shmlearn/sync/ or a folder "
                        f"of SHMLEARN_STRATEGY_PATH, whose files shmlearn.sync imports first")
    for f in fields(entry.params):
        if "config" not in f.metadata:
            raise TypeError(f"{entry.name}: parameter {f.name} names no config key (declare it with param)")
    for o in entry.options():  # a key two strategies share is one flag: one type, one default
        for name, other in entries().items():
            theirs = {x.name: x for x in other.options()}.get(o.name)
            if name != entry.name and theirs is not None and (theirs.type, theirs.default) != (o.type, o.default):
                raise TypeError(f"{entry.name}: parameter {o.name} ({o.type}, default {o.default!r}) differs "
                                f"from {name}'s ({theirs.type}, default {theirs.default!r})")
    _ENTRIES[entry.name] = entry
    return entry


def entries() -> Dict[str, Entry]:
    """Every registered strategy, by name, in registration order. Complete once this module is
    imported: importing shmlearn.sync.registry first runs shmlearn/sync/__init__.py, whose imports
    register every strategy."""
    return _ENTRIES


def names(*, fast_step: Optional[bool] = None, servers: Optional[int] = None) -> List[str]:
    """Registered names, optionally only those with(out) a fast step, or with this many serving
    ranks at their default parameters (0: every process computes)."""
    return [n for n, e in entries().items() if (fast_step is None or e.fast_step == fast_step)
            and (servers is None or e.params().servers == servers)]


DEFAULT = "allreduce"
"""The reference strategy: TrainConfig's default, and what every strategy equals at one worker."""


@dataclass(kw_only=True)
class SyncSection:
    """The sync section's own field; `section` adds the strategies' parameters to it."""

    strategy: str = DEFAULT
    """How the workers synchronize: a strategy registered in shmlearn.sync, by name."""


_COMPOSED = False
"""Whether `section` has been made: a strategy with parameters registered after it would have
parameters no TrainConfig can take (`register` refuses it)."""


def section() -> type:
    """The sync section of the run's config: SyncSection's `strategy` and every registered
    strategy's parameters as typed fields, by their config keys (a key two strategies share is
    one field), with their defaults. A dataclass made from the entries, not written out, because
    each strategy's file declares its own parameters (`param`) and a new file needs no edit
    elsewhere; made once, when shmlearn.config is imported, after shmlearn.sync has imported
    every strategy file. Their help is the registry's (`options`); their checks `spec`'s."""
    global _COMPOSED
    _COMPOSED = True
    return dataclasses.make_dataclass(
        "SyncOptions", [(o.name, o.type, field(default=o.default)) for o in options().values()],
        bases=(SyncSection,), kw_only=True, namespace={"__module__": __name__})


def get(name: str, flag: str = "--strategy") -> Entry:
    e = entries().get(name)
    if e is None:
        raise BadInput(f"{flag} {name}: choose one of {', '.join(entries())}")
    return e


def options() -> Dict[str, Option]:
    """Every registered strategy's parameters by config key, in registration order; a key two
    strategies share is one option naming both (TrainConfig's sync section: `section`)."""
    out: Dict[str, Option] = {}
    for e in entries().values():
        for o in e.options():
            prev = out.get(o.name)
            out[o.name] = o if prev is None else dataclasses.replace(prev, strategies=prev.strategies + (e.name,))
    return out


def spec(cfg) -> Spec:
    """The strategy a TrainConfig chose, with its parameters; BadInput (one line) for an unknown
    strategy, a parameter out of range or not one of its choices, or another strategy's flag."""
    entry = get(cfg.strategy)
    known = options()
    # {config key: value} of every strategy's parameter the config has (a field of its sync section)
    values = {c: getattr(cfg, c) for c in known if hasattr(cfg, c)}
    mine = entry.config_fields()
    for c, v in values.items():
        o = known[c]
        if c not in mine and v != o.default:
            given = o.flag if v is True else f"{o.flag} {v}"
            raise BadInput(f"{given}: only for --strategy {' or '.join(o.strategies)}, not {cfg.strategy}")
    entry.check(cfg)
    return entry.spec(entry.params_from(values))


def sim_variants() -> Dict[str, Tuple[Entry, Mapping[str, Any]]]:
    """simulate's strategy names: {name: (entry, fixed parameters)}."""
    return {v: (e, fixed) for e in entries().values() for v, fixed in e.sim_variants.items()}


def sim_name(entry: Entry, params) -> str:
    """The simulate name of a run's strategy: the variant whose fixed parameters it has (the most
    specific one), else the strategy's own name."""
    best, best_n = entry.name, -1
    for v, fixed in entry.sim_variants.items():
        if all(getattr(params, k) == x for k, x in fixed.items()) and len(fixed) > best_n:
            best, best_n = v, len(fixed)
    return best


def with_servers(entry: Entry, params, servers: int):
    """params, or the variant of them with `servers` serving ranks (an old summary that recorded
    only its process count)."""
    if params.servers == servers:
        return params
    for fixed in entry.sim_variants.values():
        q = dataclasses.replace(params, **fixed)
        if q.servers == servers:
            return q
    return params


def param(config: str, default) -> Any:
    """A parameter field, set by the config key `config` (YAML's `config:`, the flag
    --config-with-dashes, TrainConfig(config=...)); its type and choices: the field's annotation,
    its --help: the docstring under it."""
    return field(default=default, metadata={"config": config})
