"""Synchronization strategies, by name. Each lives in its own file over sync/base.py and
registers an entry that describes it (registry.py)."""
from __future__ import annotations

import importlib
import os
import pkgutil

from shmlearn.errors import BadInput, one_line, user_frame
from shmlearn.sync import registry
from shmlearn.sync.base import SyncStrategy, flatten_parameters
# Each import registers its strategy; this order is the order --help and messages list them in.
from shmlearn.sync.allreduce import AllReduce
from shmlearn.sync.parameter_server import ParameterServer
from shmlearn.sync.weight_averaging import WeightAveraging
from shmlearn.sync.ddp import DDP
from shmlearn.sync.async_ps import AsyncPS

# A strategy added as one more file here, or in a folder of SHMLEARN_STRATEGY_PATH (folders
# separated by os.pathsep: strategy files kept outside an installed package), registers itself on
# import, after the five above, with no edit to this file: a spawned worker imports this package
# and finds it the same way (it inherits the variable). Its module is shmlearn.sync.<file name>.
__path__ += [d for d in map(os.path.abspath, filter(None, os.environ.get("SHMLEARN_STRATEGY_PATH", "").split(
    os.pathsep))) if d not in __path__]
_OWN = {"__init__", "base", "registry", "allreduce", "parameter_server", "weight_averaging", "ddp", "async_ps"}
for _found in sorted((m for m in pkgutil.iter_modules(__path__) if m.name not in _OWN and not m.name.startswith("_")),
                     key=lambda m: m.name):
    try:
        importlib.import_module(f"{__name__}.{_found.name}")
    except (Exception, SystemExit) as _e:  # noqa: BLE001 - the user's file: one line naming it, before any worker
        # starts; a sys.exit() there ended the program with its code and no line (the campaign's exit 3)
        what = f"called sys.exit({_e.code!r})" if isinstance(_e, SystemExit) else f"raised at import: {one_line(_e)}"
        raise BadInput(f"strategy file {os.path.join(_found.module_finder.path, _found.name)}.py: {what}"
                       f"{user_frame(_e)}") from None


def build_strategy(name: str, *, rank: int, world_size: int, group=None, **config) -> SyncStrategy:
    """The strategy `name` for one rank. config: TrainConfig fields that set its parameters
    (avg_period=4); those of other strategies are ignored, missing ones take their defaults."""
    entry = registry.get(name)
    return entry.spec(entry.params_from(config)).build(rank=rank, world_size=world_size, group=group)


__all__ = ["SyncStrategy", "flatten_parameters", "build_strategy", "registry",
           "AllReduce", "ParameterServer", "WeightAveraging", "DDP", "AsyncPS"]
