"""TrainConfig composed of sections owned by their code (issue 54; config/train_config.py's
docstring): a step option added in a copy of the package touches 2 files and works end to end
(--help, YAML, flag, the step); fields stay flat; each choice is checked once, by its section.
(A strategy with a parameter as 1 new file: tests/sync/test_new_strategy.py.)"""
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
from shmlearn.config import flags
from shmlearn.config.flags import Section
from shmlearn.config.train_config import TrainConfig, _check_disjoint, options, validate
from shmlearn.data.options import DataOptions
from shmlearn.errors import BadInput
from shmlearn.step.options import StepOptions

FIELD = '''    probe_level: int = 0
    """How loud the probe is (a step option added by tests/config/test_sections.py)."""
'''
USE = '''        if opts.probe_level:  # the added option's use: the step records what it was given
            with open(os.environ["SHMLEARN_PROBE_FILE"], "a") as f:
                f.write(f"{opts.probe_level}\\n")
'''


def _edit(path: Path, after: str, text: str) -> None:
    """Insert `text` after the one occurrence of `after` in the file."""
    src = path.read_text()
    assert src.count(after) == 1, (path, after)
    path.write_text(src.replace(after, after + text))


def _changed(a: Path, b: Path) -> list:
    """Files (relative paths) added, removed or differing between two package trees."""
    out = []
    def walk(cmp: filecmp.dircmp, rel: str) -> None:
        for name in cmp.left_only + cmp.right_only + cmp.diff_files + cmp.funny_files:
            out.append(os.path.join(rel, name))
        for name, sub in cmp.subdirs.items():
            walk(sub, os.path.join(rel, name))
    walk(filecmp.dircmp(a, b, ignore=["__pycache__"]), "")
    return sorted(out)


def test_a_step_option_is_its_field_and_its_use_two_files_end_to_end(tmp_path):
    """In a copy of the package: the field in StepOptions (step/options.py) and its use in the step
    (step/fast.py) are the whole edit; then --help lists the flag with the field's docstring, the
    flag table is rebuilt for the edited sources, and a YAML key and the flag (which beats the file)
    reach the step of a 1-worker digits run, which writes what it was given."""
    package = Path(shmlearn.__file__).parent
    copy = tmp_path / "src" / "shmlearn"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    _edit(copy / "step" / "options.py", '    others read every step."""\n', FIELD)
    _edit(copy / "step" / "fast.py", "from __future__ import annotations\n", "\nimport os\n")
    _edit(copy / "step" / "fast.py", "        self.tuning = tuning\n", USE)
    assert _changed(package, copy) == [os.path.join("step", "fast.py"), os.path.join("step", "options.py")]

    probe, cache = tmp_path / "probe.txt", tmp_path / "cache"
    env = {**{k: v for k, v in os.environ.items() if k != "SHMLEARN_STRATEGY_PATH"},
           "PYTHONPATH": str(copy.parent), "SHMLEARN_CACHE_DIR": str(cache), "SHMLEARN_PROBE_FILE": str(probe)}

    def shmlearn_cli(*args):
        return subprocess.run([sys.executable, "-m", "shmlearn", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)

    r = shmlearn_cli("train", "--help")
    assert r.returncode == 0, r.stderr
    help_text = " ".join(r.stdout.split())
    assert "--probe-level PROBE_LEVEL How loud the probe is (a step option added by tests/config/test_sections.py)." \
        in help_text, r.stdout
    (table,) = cache.glob(f"{flags.TABLE_PREFIX}*.json")  # the edited sources' own table
    assert {"name": "probe_level", "kind": "int", "default": 0}.items() <= \
        next(row for row in json.loads(table.read_text()) if row["name"] == "probe_level").items()

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("dataset: digits\nworkers: 1\nbatch_size: 16\nsamples: 64\neval_points: 1\n"
                      "device: cpu\nprogress: false\nsave_model: false\nprobe_level: 3\n")
    for out, extra, want in (("from-yaml", [], 3), ("from-flag", ["--probe-level", "7"], 7)):
        probe.unlink(missing_ok=True)
        r = shmlearn_cli("train", "--config", str(recipe), "--out", str(tmp_path / out), *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        assert probe.read_text().split() == [str(want)]  # the step saw the value (one rank, once)
        saved = yaml.safe_load((tmp_path / out / "config.yaml").read_text())
        assert saved["probe_level"] == want  # config.yaml keeps it flat, beside the others


def test_fields_stay_flat_and_each_has_one_owner():
    """Keywords, attribute reads, dataclasses.replace and config.yaml see one flat namespace; each
    field is declared by exactly one section, and the config is the step's StepOptions."""
    cfg = TrainConfig(workers=2, strategy="weight-avg", lr=0.1, grad_buckets="on", avg_period=4, dataset="digits")
    assert (cfg.workers, cfg.lr, cfg.grad_buckets, cfg.avg_period) == (2, 0.1, "on", 4)
    again = dataclasses.replace(cfg, seed=5, avg_period=2)
    assert (again.seed, again.avg_period, again.grad_buckets) == (5, 2, "on")
    assert isinstance(cfg, StepOptions) and isinstance(cfg, DataOptions)
    assert list(cfg.to_dict()) == list(options()) == [f.name for f in dataclasses.fields(TrainConfig)]
    owners = {}
    for section in TrainConfig.__bases__:
        for f in dataclasses.fields(section):
            owners.setdefault(f.name, []).append(section.__name__)
    assert {n: o for n, o in owners.items() if len(o) > 1} == {}
    assert set(owners) == set(options())
    step_fields = {f.name for f in dataclasses.fields(StepOptions)}
    assert {"precision", "grad_buckets", "check_every", "cudnn_benchmark"} <= step_fields
    assert all(owners[n] == ["StepOptions"] for n in step_fields)

    @dataclasses.dataclass(kw_only=True)
    class Mine(Section):
        dataset: str = "x"
    with pytest.raises(TypeError, match="^config field dataset: declared by both DataOptions and Mine$"):
        _check_disjoint([DataOptions, Mine])


def test_each_choice_is_checked_once_by_its_section(monkeypatch):
    """A Literal field's choice is checked when its section is made: once for a TrainConfig made
    and validated (grad_buckets was checked by config and again by step/kernels.py), and a
    StepOptions made alone (the bench's) is checked the same way."""
    seen = []
    check = flags.Option.check
    monkeypatch.setattr(flags.Option, "check", lambda self, value: (seen.append(self.name), check(self, value))[1])
    validate(TrainConfig(grad_buckets="on", precision="bf16"))
    literal = [n for n, o in options().items() if o.choices is not None and not o.strategies and n != "strategy"]
    assert sorted(n for n in seen if n in literal) == sorted(literal)  # each once
    with pytest.raises(BadInput, match="^--grad-buckets sometimes: choose one of auto, on, off$"):
        StepOptions(grad_buckets="sometimes")
    with pytest.raises(BadInput, match="^--eval-at-start maybe: choose on or off$"):
        TrainConfig(eval_at_start="maybe")
