"""Synchronization strategies, by name. Each lives in its own file over sync/base.py."""
from __future__ import annotations

from shmlearn.sync.allreduce import AllReduce
from shmlearn.sync.base import SyncStrategy, flatten_parameters
from shmlearn.sync.ddp import DDP
from shmlearn.sync.parameter_server import ParameterServer
from shmlearn.sync.weight_averaging import WeightAveraging

STRATEGIES = {"allreduce": AllReduce, "ps": ParameterServer, "weight-avg": WeightAveraging, "ddp": DDP}


def build_strategy(name: str, *, rank: int, world_size: int, group=None, avg_period: int = 1,
                   ps_dedicated: bool = False) -> SyncStrategy:
    if name == "ps":
        return ParameterServer(rank=rank, world_size=world_size, group=group, dedicated=ps_dedicated)
    if name == "weight-avg":
        return WeightAveraging(rank=rank, world_size=world_size, group=group, period=avg_period)
    return STRATEGIES[name](rank=rank, world_size=world_size, group=group)


__all__ = ["SyncStrategy", "flatten_parameters", "build_strategy", "STRATEGIES",
           "AllReduce", "ParameterServer", "WeightAveraging", "DDP"]
