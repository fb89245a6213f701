"""The CLI refuses a missing --data-dir before it imports torch (cli.precheck, issue 41): the same
line as train() and load_dataset give, exit 2, from train and sweep."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmlearn.cli.main import precheck
from shmlearn.data import load_dataset
from shmlearn.errors import BadInput

ROOT = Path(__file__).resolve().parents[2]


def _program(*args, importtime=False):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *flags, "-m", "shmlearn", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_missing_data_dir_refused_without_torch(tmp_path):
    missing = str(tmp_path / "nowhere")
    r = _program("train", "--dataset", "fashion-mnist", "--data-dir", missing, importtime=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    imported = [ln.split("|")[-1].strip() for ln in lines if ln.startswith("import time:")]
    assert imported and not [m for m in imported if m.split(".")[0] == "torch"], "torch was imported"
    errors = [ln for ln in lines if not ln.startswith("import time:")]
    with pytest.raises(BadInput) as e:
        load_dataset("fashion-mnist", missing)
    assert errors == [f"shmlearn: error: {e.value}"]


def test_sweep_refused_before_any_trial(tmp_path):
    r = _program("sweep", "--dataset", "digits,mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "sw"))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"shmlearn: error: mnist: no train-images-idx3-ubyte[.gz] in {tmp_path} "
                                     "(expected the four IDX files train-images-idx3-ubyte, train-labels-idx1-ubyte, "
                                     "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each optionally gzipped)"]
    assert not (tmp_path / "sw").exists()


@pytest.mark.parametrize("argv, message", [
    (["train", "--dataset", "cifar10", "--data-dir", "/nonexistent-41"], "--data-dir /nonexistent-41: no such directory"),
    (["train", "--dataset=tiny-imagenet", "--data-dir=/nonexistent-41"], "--data-dir /nonexistent-41: no such"),
    (["train", "--dataset", "mnist"], "--data-dir: mnist needs a --data-dir"),
    (["train", "--config", "x.yaml", "--dataset", "mnist", "--data-dir", "/nonexistent-41"], "no such directory"),
    (["sweep", "--dataset", "digits,cifar10", "--data-dir", "none,/nonexistent-41"], "cifar10 needs a --data-dir"),
])
def test_precheck_refuses(argv, message):
    with pytest.raises(BadInput, match=message.replace("[", r"\[")):
        precheck(argv)


@pytest.mark.parametrize("argv", [
    ["train", "--dataset", "digits", "--data-dir", "/nonexistent-41"],  # reads no files
    ["train", "--data-dir", "/nonexistent-41"],  # the default dataset reads no files
    ["train", "--config", "x.yaml", "--dataset", "mnist"],  # the file may set --data-dir
    ["train", "--dataset", "mnist", "--data-dir", "/nonexistent-41", "--help"],
    ["report", "--dataset", "mnist", "--data-dir", "/nonexistent-41"],
    ["train", "--dataset", "pkg.mod:load", "--data-dir", "/nonexistent-41"],  # the user's own
])
def test_precheck_leaves_the_rest_to_the_full_checks(argv):
    precheck(argv)


def test_precheck_does_not_import_torch():
    code = ("import sys; from shmlearn.cli.main import precheck; from shmlearn.errors import BadInput\n"
            "try:\n    precheck(['train', '--dataset', 'mnist', '--data-dir', '/nonexistent-41'])\n"
            "except BadInput as e:\n    print(e)\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.stdout.splitlines() == ["--data-dir /nonexistent-41: no such directory", "False"], r.stderr
