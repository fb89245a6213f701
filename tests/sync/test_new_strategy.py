"""A new strategy is one file under shmlearn/sync/ (issue 40, acceptance 3; issue 54, acceptance 2;
docs/architecture.md, "How to add a strategy"), or in a folder of SHMLEARN_STRATEGY_PATH: a toy,
allreduce-half, written as allreduce_half.py and nothing else, trains end to end on 2 Gloo workers,
records its summary and timing phases, shows in `shmlearn report`, and ends with allreduce's weights
(it all-reduces the same gradient, in `pieces` all-reduces instead of one).

TrainConfig's sync section is composed of the strategies registered when shmlearn.config is first
imported (registry.section), so the toy runs in fresh interpreters that find its file as any
process shmlearn starts does; registering it later, in a process that has composed the config, is
refused (the last test)."""
import dataclasses
import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import shmlearn
from shmlearn.sync import registry
from shmlearn.sync.allreduce import AllReduce

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
def toy(tmp_path_factory):
    """The toy as a strategy file in a folder of SHMLEARN_STRATEGY_PATH, and the environment of a
    fresh interpreter that imports it as shmlearn.sync imports any strategy file (a spawned worker
    finds it through the variable). (Never written into the package under test: other test
    processes import it meanwhile.)"""
    folder = tmp_path_factory.mktemp("strategies")
    (folder / "allreduce_half.py").write_text(TOY)
    return {**os.environ, "SHMLEARN_STRATEGY_PATH": str(folder),
            "PYTHONPATH": os.path.dirname(os.path.dirname(shmlearn.__file__))}


def _fresh(code: str, env, cwd) -> str:
    """Run `code` in a fresh interpreter; its stdout (the test fails with its stderr if it fails)."""
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _changed(a: Path, b: Path) -> list:
    """Files (relative paths) added, removed or differing between two package trees."""
    out = []

    def walk(cmp: filecmp.dircmp, rel: str) -> None:
        out.extend(os.path.join(rel, n) for n in cmp.left_only + cmp.right_only + cmp.diff_files + cmp.funny_files)
        for name, sub in cmp.subdirs.items():
            walk(sub, os.path.join(rel, name))
    walk(filecmp.dircmp(a, b, ignore=["__pycache__"]), "")
    return sorted(out)


def test_a_file_dropped_into_the_packages_sync_folder_is_the_whole_edit(tmp_path):
    """The toy as one more file of shmlearn/sync/ itself, in a copy of the package (the only file
    that differs): a fresh interpreter (as a spawned worker is) registers it last with its
    parameter, `train --help` lists the parameter under its strategy with its docstring, and a
    YAML key and the flag (which beats the file) reach the strategy of a 1-worker digits run."""
    package = Path(shmlearn.__file__).parent
    copy = tmp_path / "src" / "shmlearn"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "sync" / "allreduce_half.py").write_text(TOY)
    assert _changed(package, copy) == [os.path.join("sync", "allreduce_half.py")]
    env = {k: v for k, v in os.environ.items() if k != "SHMLEARN_STRATEGY_PATH"}
    env.update(PYTHONPATH=str(copy.parent), SHMLEARN_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import shmlearn.sync as s; from shmlearn.config.train_config import TrainConfig; "
            "print(s.__file__, list(s.registry.entries())[-1], TrainConfig(allreduce_pieces=3).allreduce_pieces)")
    path, name, pieces = _fresh(code, env, tmp_path).split()
    assert path == str(copy / "sync" / "__init__.py")
    assert (name, pieces) == ("allreduce-half", "3")

    def shmlearn_cli(*args):
        r = subprocess.run([sys.executable, "-m", "shmlearn", *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    help_text = " ".join(shmlearn_cli("train", "--help").split())
    assert ("--strategy allreduce-half: --allreduce-pieces ALLREDUCE_PIECES All-reduces per step, each over one "
            "piece of the flat gradient.") in help_text, help_text
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("dataset: digits\nworkers: 1\nbatch_size: 16\nsamples: 64\neval_points: 1\ndevice: cpu\n"
                      "progress: false\nsave_model: false\nstrategy: allreduce-half\nallreduce_pieces: 3\n")
    for out, extra, want in (("from-yaml", [], 3), ("from-flag", ["--allreduce-pieces", "5"], 5)):
        shmlearn_cli("train", "--config", str(recipe), "--out", str(tmp_path / out), *extra)
        summary = json.loads((tmp_path / out / "summary.json").read_text())
        assert (summary["strategy"], summary["strategy_params"]) == ("allreduce-half", {"pieces": want})
        assert yaml.safe_load((tmp_path / out / "config.yaml").read_text())["allreduce_pieces"] == want

TRAIN_BOTH = f'''
import json, sys
import torch
from shmlearn.cli.main import main
from shmlearn.config.train_config import TrainConfig
from shmlearn.sync import registry
from shmlearn.train.entry import train
assert "allreduce-half" in registry.entries()
def run(out, strategy):
    return train(TrainConfig(model="mlp", dataset="digits", strategy=strategy, optimizer="momentum", lr=0.1,
                             batch_size={B}, samples={STEPS} * 2 * {B}, workers=2, eval_points=1, progress=False,
                             out=out))
def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
toy, ref = run("toy", "allreduce-half"), run("ref", "allreduce")
# The same averaged gradient, all-reduced in two pieces: the same weights as allreduce.
torch.testing.assert_close(flat(toy.model), flat(ref.model), rtol=1e-5, atol=1e-6)
assert main(["report", str(toy.run_dir), str(ref.run_dir), "--out", "report.html"]) == 0
print(json.dumps([str(toy.run_dir), str(ref.run_dir)]))
'''


def test_toy_strategy_in_one_file_trains_reports_and_equals_allreduce(tmp_path, toy):
    toy_dir, _ = json.loads(_fresh(TRAIN_BOTH, toy, tmp_path).splitlines()[-1])
    s = json.loads((tmp_path / toy_dir / "summary.json").read_text())  # run_dir: relative to the run's cwd
    assert s["strategy"] == "allreduce-half" and s["strategy_params"] == {"pieces": 2}
    assert s["allreduce_calls"] == 2 * STEPS  # its own summary field, from its entry
    assert s["steps"] == STEPS
    assert s["phase_s"]["allreduce"] > 0 and s["phase_s"]["update"] > 0  # its timed phases
    assert "allreduce-half" in (tmp_path / "report.html").read_text()


FLAG_YAML_SWEEP = '''
import pytest
from shmlearn.cli.main import build_parser, config_from_args
from shmlearn.config.train_config import TrainConfig, load_yaml, save_yaml, validate
from shmlearn.errors import BadInput
from shmlearn.sweeps.grid import split_axes
from shmlearn.sync import registry
assert registry.spec(TrainConfig(strategy="allreduce-half", allreduce_pieces=3)).params.pieces == 3
parser = build_parser()
cfg = config_from_args(parser.parse_args(["train", "--strategy", "allreduce-half", "--allreduce-pieces", "3"]))
assert cfg.allreduce_pieces == 3 and registry.spec(cfg).flags() == "--strategy allreduce-half --allreduce-pieces 3"
train_p = parser._subparsers._group_actions[0].choices["train"]
group = next(g for g in train_p._action_groups if g.title == "--strategy allreduce-half")
(action,) = [a for a in group._group_actions if a.dest == "allreduce_pieces"]
assert action.type is int and "All-reduces per step" in action.help and "[default: 2]" in action.help
# config.yaml: the key beside the others, read back the same
save_yaml(cfg, "config.yaml")
saved = load_yaml("config.yaml")
assert saved["allreduce_pieces"] == 3 and TrainConfig.from_dict(saved) == cfg
# the sweep: an axis of whole numbers
fixed, axes = split_axes({"strategy": "allreduce-half", "allreduce_pieces": "2:4"})
assert axes == {"allreduce_pieces": [2, 3, 4]}
# its own range check, and no other strategy takes it
with pytest.raises(BadInput, match="^--allreduce-pieces 0: expected"):
    validate(TrainConfig(strategy="allreduce-half", allreduce_pieces=0))
with pytest.raises(BadInput, match="^--allreduce-pieces 3: only for --strategy allreduce-half, not allreduce$"):
    validate(TrainConfig(allreduce_pieces=3))
print("ok")
'''


def test_toy_strategy_parameter_is_a_keyword_a_flag_a_yaml_key_and_a_sweep_axis(toy, tmp_path):
    """The toy's one declaration (param("allreduce_pieces", 2), its type and docstring) is all
    the config, the train and sweep flags, --help, config.yaml and the refusals read."""
    assert _fresh(FLAG_YAML_SWEEP, toy, tmp_path).split()[-1] == "ok"


def test_a_strategy_with_parameters_registered_after_the_config_is_composed_is_refused():
    """Its parameters could be set nowhere (TrainConfig's fields are made): one line saying where
    its file goes, and the registry is left as it was."""
    from shmlearn.config.train_config import TrainConfig  # composes TrainConfig (already, in this process)
    from shmlearn.sync.weight_averaging import Params
    assert "avg_period" in {f.name for f in dataclasses.fields(TrainConfig)}
    before = dict(registry.entries())
    late = registry.Entry(name="late", cls=AllReduce, help="registered late", params=Params)
    with pytest.raises(TypeError, match=r"^strategy late: registered after TrainConfig was composed .* "
                                        r"SHMLEARN_STRATEGY_PATH, whose files shmlearn.sync imports first$"):
        registry.register(late)
    assert registry.entries() == before
    # A strategy without parameters adds no field: it may still come late.
    none = registry.register(dataclasses.replace(late, params=registry.NoParams))
    try:
        assert registry.get("late") is none
    finally:
        registry.entries().pop("late")
