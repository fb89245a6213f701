"""Issue 53: one type check of config values against the typed config (flags.Option.coerce), for
a train --config file, a sweep's, config.yaml read back and values from Python; YAML 1.1's
yes/no/on/off read as the user meant, or refused saying why; an alias bomb refused in one line.

Every CLI case asserts exit 2, exactly one line on stderr naming the file and the key, and no
traceback, before any worker starts (the refusals come from config_from_args, in this process)."""
import pytest

from shmlearn.config.train_config import TrainConfig, load_yaml, validate
from shmlearn.errors import BadInput

from tests.cli_inproc import run_main


def _refused(args, monkeypatch, capfd):
    r = run_main(args, monkeypatch, capfd)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize("text,key,said,expected", [
    ("init: 5", "init", "5 is a whole number", "expected a string"),          # was AttributeError: partition
    ("optimizer: 3", "optimizer", "3 is a whole number", "expected a string"),  # was AttributeError: isidentifier
    ("augment: 2", "augment", "2 is a whole number", "expected a string"),      # was AttributeError: strip
    ("data_dir: 4", "data_dir", "4 is a whole number", "expected a string or null"),  # was a worker's TypeError
    ("out: [a, b]", "out", "['a', 'b'] is a list", "expected a string or null"),  # was accepted
    ("out: 2024-01-01", "out", "2024-01-01 is a date", "quote it"),              # was accepted
    ("batch_size: 2.5", "batch_size", "2.5 is a number", "expected a whole number"),
    ("threads: '2'", "threads", "'2' is a string", "expected a whole number or null"),
    ("checkpoint_every: 1.5", "checkpoint_every", "1.5 is a number", "expected a whole number or a string"),
    ("data_dir: true", "data_dir", "true is a boolean", "quote it"),
], ids=["init", "optimizer", "augment", "data_dir", "out-list", "out-date", "batch-float", "threads-str",
        "ckpt-float", "data_dir-bool"])
def test_a_yaml_value_of_the_wrong_type_is_one_line_naming_file_key_value_and_type(
        tmp_path, monkeypatch, capfd, text, key, said, expected):
    path = tmp_path / "c.yaml"
    path.write_text(f"workers: 1\nsamples: 64\n{text}\n")
    line = _refused(["train", "--config", str(path), "--no-progress"], monkeypatch, capfd)
    assert f"--config {path}: {key} {said}" in line and expected in line, line


@pytest.mark.parametrize("text,key,word", [
    ("out: no", "out", "no"), ("init: on", "init", "on"), ("model: yes", "model", "yes")])
def test_a_yaml11_word_for_a_string_is_refused_saying_why(tmp_path, monkeypatch, capfd, text, key, word):
    path = tmp_path / "c.yaml"
    path.write_text(f"workers: 1\n{text}\n")
    line = _refused(["train", "--config", str(path)], monkeypatch, capfd)
    assert f"{key} {word}: YAML 1.1 reads the unquoted word {word} as the boolean" in line
    assert f'quote it ({key}: "{word}")' in line, line


def test_yaml11_words_are_read_as_meant_where_the_field_takes_them(tmp_path):
    path = tmp_path / "c.yaml"
    # bool fields: unquoted YAML 1.1 words and quoted ones alike; on/off fields: the word itself
    path.write_text('deterministic: yes\nchannels_last: "on"\nsave_model: "no"\nprogress: off\n'
                    'compile: off\ncudnn_benchmark: off\neval_at_start: on\nlr: 1e-3\n')
    cfg = TrainConfig.from_dict(load_yaml(str(path)), source=str(path))
    assert (cfg.deterministic, cfg.channels_last, cfg.save_model, cfg.progress) == (True, True, False, False)
    assert (cfg.compile, cfg.cudnn_benchmark, cfg.eval_at_start) == ("off", "off", "on")
    assert cfg.lr == 0.001 and type(cfg.lr) is float  # YAML 1.1 leaves 1e-3 (no dot) as text
    validate(cfg)


def test_a_word_no_field_takes_is_refused_naming_its_choices(tmp_path, monkeypatch, capfd):
    path = tmp_path / "c.yaml"
    path.write_text("compile: yes\n")
    line = _refused(["train", "--config", str(path)], monkeypatch, capfd)
    assert "compile yes: YAML 1.1 reads the unquoted word yes as the boolean true; expected one of off," in line


def test_a_quoted_bool_word_that_is_not_one_is_refused(tmp_path, monkeypatch, capfd):
    path = tmp_path / "c.yaml"
    path.write_text('save_model: "nope"\n')
    line = _refused(["train", "--config", str(path)], monkeypatch, capfd)
    assert f"--config {path}: save_model 'nope' is a string; expected true or false" in line


def test_values_from_python_are_checked_by_validate():
    for kwargs, needle in (({"out": ["a"]}, "--out ['a'] is a list; expected a string or null"),
                           ({"save_model": "no"}, "--save-model 'no' is a string; expected true or false"),
                           ({"init": 5}, "--init 5 is a whole number; expected a string"),
                           ({"avg_period": "4", "strategy": "weight-avg"}, "--avg-period '4' is a string")):
        with pytest.raises(BadInput) as e:
            validate(TrainConfig(**kwargs))
        assert needle in str(e.value), str(e.value)


def test_config_yaml_read_back_is_type_checked(tmp_path):
    from shmlearn import load_model
    (tmp_path / "config.yaml").write_text("model: 7\n")
    with pytest.raises(BadInput) as e:
        load_model(str(tmp_path))
    assert f"{tmp_path / 'config.yaml'}: model 7 is a whole number; expected a string" in str(e.value)


BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9 if p else ['lol'] * 9)}]\n"
               for p, c in zip([None, "a", "b", "c", "d", "e", "f", "g"], "abcdefgh")) + "out: *h\n"


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_yaml_alias_bomb_is_one_short_line(tmp_path, monkeypatch, capfd, command):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)  # 9**8 = 43 million values once expanded
    line = _refused([command, "--config", str(path)], monkeypatch, capfd)
    assert f"--config {path}: its aliases expand to more than 100,000 values" in line and len(line) < 300


def test_an_expanded_value_in_a_message_is_cut_short(tmp_path, monkeypatch, capfd):
    path = tmp_path / "c.yaml"
    path.write_text("out: [&a [" + ", ".join(["x" * 50] * 40) + "], *a, *a]\n")
    line = _refused(["train", "--config", str(path)], monkeypatch, capfd)
    assert f"--config {path}: out [[" in line and "is a list" in line and len(line) < 400, line


@pytest.mark.parametrize("text,needle", [
    ("init: 5", "init 5 is a whole number; expected a string"),
    ("lr: [0.1, true]", "lr true is a boolean; expected a number"),
    ("data_dir: no", "data_dir no: YAML 1.1 reads the unquoted word no as the boolean false"),
])
def test_a_sweep_config_value_of_the_wrong_type_is_one_line(tmp_path, monkeypatch, capfd, text, needle):
    path = tmp_path / "s.yaml"
    path.write_text(f"workers: 1\n{text}\n")
    line = _refused(["sweep", "--config", str(path), "--out", str(tmp_path / "sw")], monkeypatch, capfd)
    assert f"--config {path}: {needle}" in line, line
    assert not (tmp_path / "sw").exists()


def test_a_sweep_config_reads_yaml11_words_by_the_field():
    from shmlearn.record.readback import Word
    from shmlearn.sweeps.cli import _typed
    fixed = _typed({"deterministic": [Word("on"), Word("off")], "compile": Word("off")}, "--config s.yaml")
    assert fixed == {"deterministic": [True, False], "compile": "off"}
    from shmlearn.sweeps.grid import parse_values
    assert parse_values("deterministic", "on,off") == [True, False]
