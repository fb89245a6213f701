"""The registry's strategy names as the parsers of `bench throughput` and `simulate` list them, read
without torch (issue 53: their --help imported it, 2-6 s on a loaded 2-core machine).

The registry is complete only once every strategy's module is imported (shmlearn/sync/__init__.py),
and those import torch. What the parsers need is plain data, kept in the user's cache per digest
of the sources (config.flags.keep, as the train flag table is) by any process that read it live.
"""
from __future__ import annotations

import sys
from typing import Dict, List

from shmlearn.config import flags

PREFIX = "strategies-"
KEYS = ("names", "default", "fast_compute", "simulate")


def _live() -> Dict[str, object]:
    from shmlearn.sync import registry  # lazy: torch (the strategies' modules), where nothing is kept
    return {"names": list(registry.entries()), "default": registry.DEFAULT,
            "fast_compute": registry.names(fast_step=True, servers=0), "simulate": list(registry.sim_variants())}


def names() -> Dict[str, object]:
    """{"names": every registered strategy, "default": the reference strategy, "fast_compute":
    those with a fast step whose every process computes (bench throughput's, simulate's default),
    "simulate": the names simulate predicts (each strategy's variants)}: kept, where this
    process has not imported the registry; read live otherwise (a strategy a test registers late
    is in no table), and kept."""
    if "shmlearn.sync" not in sys.modules:
        kept = flags.read_kept(PREFIX)
        if isinstance(kept, dict) and all(isinstance(kept.get(k), (list, str)) for k in KEYS):
            return kept
    live = _live()
    flags.keep(PREFIX, live)
    return live


def listed(key: str) -> List[str]:
    value = names()[key]
    return list(value) if isinstance(value, list) else [str(value)]
