"""refs.py: `FILE.py:NAME` and `pkg.module:NAME` name the user's own code; every way a reference
can be wrong is one BadInput line naming the flag. Also parts.label / resolve_ref, which turn
objects passed from Python into the labels config.yaml records.
"""
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from shmlearn.errors import BadInput
from shmlearn.user.parts import Parts, label, resolve_ref
from shmlearn.user.refs import call_user, is_ref, load_ref


class TopLevelNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


def top_level_builder():
    return TopLevelNet()


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    return msg


def _write(folder, name, text):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("text,want", [
    ("mlp", False), ("resnet18", False), ("x.py:Net", True), ("pkg.mod:Net", True),
    ("dir/x.py:Net.build", True), (":Net", False), ("x.py:", False), ("", False),
])
def test_is_ref_tells_references_from_registered_names(text, want):
    assert is_ref(text) is want


def test_a_file_reference_gives_the_object_and_its_neighbours_import(tmp_path):
    _write(tmp_path, "helper_mod_for_refs.py", "WIDTH = 7\n")
    path = _write(tmp_path, "net.py", """
        from torch import nn
        from helper_mod_for_refs import WIDTH   # a sibling module, as in a script
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(WIDTH, 2)
            class Inner:
                value = 3
        def build():
            return Net()
        """)
    Net = load_ref(f"{path}:Net", "--model")
    assert Net().fc.in_features == 7
    assert load_ref(f"{path}:Net.Inner", "--model").value == 3  # dotted NAME
    # one module per file: a second load (the next sweep trial) gives the very same objects
    assert load_ref(f"{path}:Net", "--model") is Net
    assert load_ref(f"{path}:build", "--model")().__class__ is Net


def test_a_relative_file_reference_is_read_from_the_working_directory(tmp_path, monkeypatch):
    _write(tmp_path, "rel_net_for_refs.py", "VALUE = 11\n")
    monkeypatch.chdir(tmp_path)
    assert load_ref("rel_net_for_refs.py:VALUE", "--dataset") == 11


def test_a_module_reference_imports_by_name():
    assert load_ref("torch.nn:Linear", "--model") is nn.Linear
    assert load_ref("test_refs:top_level_builder", "--model") is top_level_builder


def test_a_missing_file_is_one_line_naming_the_flag(tmp_path):
    ref = f"{tmp_path}/nothere.py:Net"
    with pytest.raises(BadInput) as e:
        load_ref(ref, "--model")
    msg = _one_line(e)
    assert msg.startswith(f"--model {ref}:") and "does not exist" in msg


def test_a_file_lacking_name_lists_what_it_has(tmp_path):
    path = _write(tmp_path, "some.py", """
        import numpy as np                 # imported names are not the file's own
        from torch import nn
        class Net(nn.Module):
            pass
        def load():
            return None
        _private = 1
        """)
    with pytest.raises(BadInput) as e:
        load_ref(f"{path}:Model", "--model")
    msg = _one_line(e)
    assert msg.startswith(f"--model {path}:Model:")
    assert "has no 'Model'" in msg
    assert msg.endswith("(it has Net, load)"), msg  # not np, nn or _private


def test_a_missing_package_is_one_line(tmp_path):
    with pytest.raises(BadInput) as e:
        load_ref("no_such_pkg_shmlearn_test.data:load", "--dataset")
    msg = _one_line(e)
    assert msg.startswith("--dataset no_such_pkg_shmlearn_test.data:load:")
    assert "no module named 'no_such_pkg_shmlearn_test'" in msg


def test_a_module_lacking_name_lists_what_it_has():
    with pytest.raises(BadInput) as e:
        load_ref("shmlearn.user.refs:nothing_here", "--model")
    msg = _one_line(e)
    assert "has no 'nothing_here'" in msg and "load_ref" in msg


@pytest.mark.parametrize("body,kind", [
    ("raise RuntimeError('cannot find /data/x\\nsecond line')", "RuntimeError: cannot find /data/x"),
    ("def broken(:\n    pass", "SyntaxError"),
    ("import sys\nsys.exit(3)", "SystemExit"),
])
def test_a_file_that_fails_to_import_is_one_line(tmp_path, body, kind):
    path = tmp_path / "bad.py"
    path.write_text(body + "\n")
    with pytest.raises(BadInput) as e:
        load_ref(f"{path}:Net", "--model")
    msg = _one_line(e)
    assert msg.startswith(f"--model {path}:Net: importing {path} raised {kind}"), msg
    # a fixed file loads on the next try (the failed module was not kept)
    path.write_text("Net = 5\n")
    assert load_ref(f"{path}:Net", "--model") == 5


def test_call_user_turns_what_the_users_code_raises_into_one_line():
    def load():
        raise FileNotFoundError("data.npz\nmore detail")
    with pytest.raises(BadInput) as e:
        call_user(load, (), "data=")
    assert _one_line(e) == ("data=: test_call_user_turns_what_the_users_code_raises_into_one_line."
                            "<locals>.load() raised FileNotFoundError: data.npz")
    assert call_user(lambda a, b: a + b, (1, 2), "x") == 3


def test_labels_name_top_level_code_and_say_what_else_was_passed():
    assert label(TopLevelNet()) == "python:TopLevelNet instance"  # its class would not rebuild its weights
    assert label(TopLevelNet) == "test_refs:TopLevelNet"
    assert label(top_level_builder) == "test_refs:top_level_builder"
    assert label(lambda: None) == "python:function"
    x = np.zeros((4, 2))
    assert label((x, x, x, x)) == "python:ndarray arrays"
    t = torch.zeros(2)
    assert label((t, t)) == "python:Tensor pair"
    # a label that names top-level code is a reference that runs again
    assert load_ref(label(top_level_builder), "--model") is top_level_builder


def test_labelled_config_records_the_parts_and_drops_data_dir():
    from shmlearn.config.train_config import TrainConfig
    cfg = Parts(model=TopLevelNet, data=top_level_builder).labelled(TrainConfig(data_dir="/data"))
    assert (cfg.model, cfg.dataset, cfg.data_dir) == ("test_refs:TopLevelNet", "test_refs:top_level_builder", None)
    # the loss is recorded too (--loss), by the reference that imports it again
    assert Parts(loss=nn.functional.mse_loss).labelled(TrainConfig()) == TrainConfig(loss="torch.nn.functional:mse_loss")


def test_a_python_label_cannot_be_loaded_again_and_says_so():
    with pytest.raises(BadInput) as e:
        resolve_ref("python:ndarray arrays", "--dataset")
    msg = _one_line(e)
    assert msg.startswith("--dataset python:ndarray arrays:") and "data=" in msg
