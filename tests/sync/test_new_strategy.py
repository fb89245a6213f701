"""A new strategy is one file under shmlearn/sync/ (issue 40, acceptance 3; docs/architecture.md,
"How to add a strategy"), or in a folder of SHMLEARN_STRATEGY_PATH: a toy, allreduce-half, written
as allreduce_half.py and nothing else, trains end to end on 2 Gloo workers, records its summary and timing phases, shows
in `shmlearn report`, and ends with allreduce's weights (it all-reduces the same gradient, in
`pieces` all-reduces instead of one)."""
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shmlearn.sync
from shmlearn.cli.main import main
from shmlearn.config.train_config import TrainConfig
from shmlearn.sync import registry
from shmlearn.train.entry import train

TOY = '''"""allreduce-half: the gradient averaged in `pieces` all-reduces (a toy: tests/sync/test_new_strategy.py)."""
from __future__ import annotations

from dataclasses import dataclass

from shmlearn.config.limits import whole
from shmlearn.sync.base import SyncStrategy
from shmlearn.sync.registry import Entry, param, register


@dataclass(frozen=True)
class Params:
    pieces: int = param("allreduce_pieces", 2)
    """All-reduces per step, each over one piece of the flat gradient."""

    servers = 0

    def __post_init__(self):
        whole("allreduce-pieces", self.pieces, 1)


class AllReduceHalf(SyncStrategy):
    name = "allreduce-half"

    def __init__(self, *, rank: int, world_size: int, group=None, pieces: int = 2):
        super().__init__(rank=rank, world_size=world_size, group=group)
        self.pieces = pieces
        self.calls = 0

    def step(self, timer) -> None:
        if self.world_size > 1:
            with timer.phase("allreduce"):
                for piece in self.grads_flat.chunk(self.pieces):
                    self._average_(piece)
                    self.calls += 1
        with timer.phase("update"):
            self.update_params()


ENTRY = register(Entry(name="allreduce-half", cls=AllReduceHalf, help="gradient all-reduce in pieces (a toy)",
                       params=Params, summary=lambda s: {"allreduce_calls": s.calls}))
'''

STEPS, B = 6, 16


@pytest.fixture
def toy(tmp_path_factory, monkeypatch):
    """The toy as a strategy file in a folder of SHMLEARN_STRATEGY_PATH: this process imports it as
    shmlearn.sync imports any strategy file, and a spawned worker finds it through the variable.
    (Never written into the package under test: other test processes import it meanwhile.)"""
    folder = str(tmp_path_factory.mktemp("strategies"))
    with open(os.path.join(folder, "allreduce_half.py"), "w") as f:
        f.write(TOY)
    monkeypatch.setenv("SHMLEARN_STRATEGY_PATH", folder)
    shmlearn.sync.__path__.append(folder)
    try:
        yield importlib.import_module("shmlearn.sync.allreduce_half")
    finally:
        shmlearn.sync.__path__.remove(folder)
        registry.entries().pop("allreduce-half", None)
        sys.modules.pop("shmlearn.sync.allreduce_half", None)


def test_a_file_dropped_into_the_packages_sync_folder_registers_in_a_fresh_process(tmp_path):
    """The toy as one more file of shmlearn/sync/ itself, in a copy of the package: a fresh
    interpreter (as a spawned worker is) registers it with its parameter, and it comes last."""
    shutil.copytree(os.path.dirname(shmlearn.__file__), tmp_path / "shmlearn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "shmlearn" / "sync" / "allreduce_half.py").write_text(TOY)
    code = ("import shmlearn.sync as s; from shmlearn.config.train_config import TrainConfig; "
            "print(s.__file__, list(s.registry.entries())[-1], TrainConfig(allreduce_pieces=3).allreduce_pieces)")
    env = {k: v for k, v in os.environ.items() if k != "SHMLEARN_STRATEGY_PATH"}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    path, name, pieces = r.stdout.split()
    assert path == str(tmp_path / "shmlearn" / "sync" / "__init__.py")
    assert (name, pieces) == ("allreduce-half", "3")


def _run(out: Path, strategy: str, **kw):
    return train(TrainConfig(model="mlp", dataset="digits", strategy=strategy, optimizer="momentum", lr=0.1,
                             batch_size=B, samples=STEPS * 2 * B, workers=2, eval_points=1, progress=False,
                             out=str(out), **kw))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_toy_strategy_in_one_file_trains_reports_and_equals_allreduce(tmp_path, toy):
    assert "allreduce-half" in registry.entries()
    toy_run = _run(tmp_path / "toy", "allreduce-half")
    ref = _run(tmp_path / "ref", "allreduce")
    # The same averaged gradient, all-reduced in two pieces: the same weights as allreduce.
    torch.testing.assert_close(_flat(toy_run.model), _flat(ref.model), rtol=1e-5, atol=1e-6)
    s = json.loads((Path(toy_run.run_dir) / "summary.json").read_text())
    assert s["strategy"] == "allreduce-half" and s["strategy_params"] == {"pieces": 2}
    assert s["allreduce_calls"] == 2 * STEPS  # its own summary field, from its entry
    assert s["steps"] == STEPS
    assert s["phase_s"]["allreduce"] > 0 and s["phase_s"]["update"] > 0  # its timed phases
    html = tmp_path / "report.html"
    assert main(["report", str(toy_run.run_dir), str(ref.run_dir), "--out", str(html)]) == 0
    assert "allreduce-half" in html.read_text()


def test_toy_strategy_parameter_through_the_config(toy):
    cfg = TrainConfig(strategy="allreduce-half", allreduce_pieces=3)
    assert registry.spec(cfg).params.pieces == 3


def test_toy_strategy_parameter_is_a_flag_a_yaml_key_and_a_sweep_axis(toy, tmp_path):
    """The toy's one declaration (param("allreduce_pieces", 2), its type and docstring) is all
    the config, the train and sweep flags, --help, config.yaml and the refusals read."""
    from shmlearn.cli.main import build_parser, config_from_args
    from shmlearn.config.train_config import load_yaml, save_yaml, validate
    from shmlearn.errors import BadInput
    from shmlearn.sweeps.grid import split_axes
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["train", "--strategy", "allreduce-half", "--allreduce-pieces", "3"]))
    assert cfg.allreduce_pieces == 3 and registry.spec(cfg).flags() == "--strategy allreduce-half --allreduce-pieces 3"
    train_p = parser._subparsers._group_actions[0].choices["train"]
    group = next(g for g in train_p._action_groups if g.title == "--strategy allreduce-half")
    (action,) = [a for a in group._group_actions if a.dest == "allreduce_pieces"]
    assert action.type is int and "All-reduces per step" in action.help and "[default: 2]" in action.help
    # config.yaml: the key beside the others, read back the same
    save_yaml(cfg, str(tmp_path / "config.yaml"))
    saved = load_yaml(str(tmp_path / "config.yaml"))
    assert saved["allreduce_pieces"] == 3 and TrainConfig.from_dict(saved) == cfg
    # the sweep: an axis of whole numbers
    fixed, axes = split_axes({"strategy": "allreduce-half", "allreduce_pieces": "2:4"})
    assert axes == {"allreduce_pieces": [2, 3, 4]}
    # its own range check, and no other strategy takes it
    with pytest.raises(BadInput, match="^--allreduce-pieces 0: expected"):
        validate(TrainConfig(strategy="allreduce-half", allreduce_pieces=0))
    with pytest.raises(BadInput, match="^--allreduce-pieces 3: only for --strategy allreduce-half, not allreduce$"):
        validate(TrainConfig(allreduce_pieces=3))
