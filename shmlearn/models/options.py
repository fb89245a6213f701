"""The model's section of the run's config (ModelOptions): which model, its layers and its
initial weights. TrainConfig is composed of it (config/train_config.py); the builders read it
(models/__init__.py, nn/folded_linear.py)."""
from __future__ import annotations

from dataclasses import dataclass

from shmlearn.config.flags import Section


@dataclass(kw_only=True)
class ModelOptions(Section):
    """The model and how its layers are built and initialized."""

    model: str = "mlp"
    """A built-in model by name (shmlearn.models.MODELS), or your own:
    FILE.py:NAME or pkg.module:NAME, NAME an nn.Module class or a callable returning a module."""
    folded_linear: bool = False
    """Build every fully connected layer as a bias-folded FoldedLinear (paper §4) instead of nn.Linear."""
    init: str = "default"
    """default (torch's init) or uniform:A (every parameter uniform in [-A, A])."""
