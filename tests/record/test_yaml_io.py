"""record/yaml_io.py: the same config.yaml text as yaml.safe_dump and the same values back as
yaml.safe_load, through libyaml where PyYAML has it (and PyYAML's own classes where it has not)."""
import math

import pytest
import yaml

from shmlearn.config.train_config import TrainConfig
from shmlearn.record import yaml_io

AWKWARD = {"out": "/tmp/a dir: with colon #and hash", "lr": 1e-05, "wd": 0.0, "inf": math.inf, "yes": "yes",
           "on": True, "none": None, "unicode": "épsilon", "long": "x" * 200, "nested": {"a": [1, 2.5, "3"]},
           "multi": "line one\nline two"}


@pytest.mark.parametrize("data", [TrainConfig(model="alexnet-small", lr=0.1, out="/tmp/run").to_dict(), AWKWARD],
                         ids=["config", "awkward"])
def test_the_text_and_the_values_are_pyyamls(data):
    text = yaml_io.dump(data)
    assert text == yaml.safe_dump(data, sort_keys=False)
    assert yaml_io.load(text) == yaml.safe_load(text)


def test_without_libyaml_it_is_pyyamls_python(monkeypatch):
    monkeypatch.setattr(yaml_io, "DUMPER", yaml.SafeDumper)
    monkeypatch.setattr(yaml_io, "LOADER", yaml.SafeLoader)
    assert yaml_io.dump(AWKWARD) == yaml.safe_dump(AWKWARD, sort_keys=False)
    assert yaml_io.load(yaml_io.dump(AWKWARD)) == yaml.safe_load(yaml.safe_dump(AWKWARD))

