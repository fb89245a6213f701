"""shmlearn/record/safe_write.py (issue 53): no write follows a symlink out of the output folder, whole
files are written atomically, and no temporary file is left on any error, a full disk included.

A full disk is RLIMIT_FSIZE in a child process (as tests/test_reliability.py makes one): a write
past the limit fails with EFBIG (Python ignores SIGXFSZ), as one past a full disk fails with
ENOSPC; both are safe_write.FULL."""
import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest

import shmlearn
from shmlearn.train import checkpoint as ckpt
from shmlearn.record import safe_write
from shmlearn.errors import BadInput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shmlearn.__file__)))
"""Where the children import shmlearn from: the one this test process imported."""


def _outside(tmp_path, text="keep me\n"):
    """A file outside the output folder that a planted link points to."""
    f = tmp_path / "outside" / "victim.txt"
    f.parent.mkdir()
    f.write_text(text)
    return f


def test_a_link_out_of_the_folder_is_refused_naming_it_and_its_target(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    victim = _outside(tmp_path)
    (out / "summary.json").symlink_to(victim)
    with pytest.raises(BadInput) as e:
        safe_write.write_json(str(out / "summary.json"), {"a": 1}, root=str(out))
    assert str(out / "summary.json") in str(e.value) and str(victim) in str(e.value)
    assert victim.read_text() == "keep me\n" and (out / "summary.json").is_symlink()


def test_a_dangling_link_out_of_the_folder_creates_nothing_there(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "elsewhere" / "config.yaml"
    target.parent.mkdir()
    (out / "config.yaml").symlink_to(target)
    for write in (lambda p: safe_write.write(p, "x", root=str(out)),
                  lambda p: safe_write.open_log(p, root=str(out))):
        with pytest.raises(BadInput):
            write(str(out / "config.yaml"))
    assert not target.exists()


def test_a_linked_folder_inside_the_output_leading_out_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    away = tmp_path / "away"
    away.mkdir()
    (out / "checkpoints").symlink_to(away)
    with pytest.raises(BadInput) as e:
        safe_write.makedirs(str(out / "checkpoints" / "step-00000010"), root=str(out))
    assert "checkpoints: a symlink to" in str(e.value)
    assert list(away.iterdir()) == []


def test_links_that_stay_inside_and_an_output_folder_that_is_itself_a_link_are_written(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    out = tmp_path / "out"
    out.symlink_to(real)  # the user's own --out: where they asked the files to go
    (real / "sub").mkdir()
    (real / "alias").symlink_to(real / "sub")
    safe_write.write(str(out / "alias" / "a.txt"), "inside", root=str(out))
    assert (real / "sub" / "a.txt").read_text() == "inside"


def test_a_log_is_appended_and_truncated_only_when_asked(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n')
    with safe_write.open_log(str(p)) as f:
        f.write('{"step": 2}\n')
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    with safe_write.open_log(str(p), truncate=True) as f:
        f.write('{"step": 3}\n')
    assert p.read_text() == '{"step": 3}\n'


def test_an_error_in_the_writer_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "winners.json"
    p.write_text("old")
    with pytest.raises(ZeroDivisionError):
        with safe_write.atomic_file(str(p), "w") as f:
            f.write("half of a new")
            1 / 0
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["winners.json"]


def _with_small_files(code, limit, cwd):
    """Run `code` in a child whose files may not grow past `limit` bytes (a full disk)."""
    def small():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd, preexec_fn=small)


def test_a_full_disk_keeps_the_old_file_names_the_file_and_leaves_no_temporary(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"old")
    r = _with_small_files("""
        import errno
        from shmlearn.record import safe_write
        try:
            safe_write.write("big.bin", b"x" * 100_000)
        except OSError as e:
            print(e.errno in safe_write.FULL, e.filename)
    """, 10_000, tmp_path)
    assert r.stdout.split() == ["True", "big.bin"], r.stdout + r.stderr
    assert (tmp_path / "big.bin").read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["big.bin"]


def test_a_full_disk_at_checkpoint_time_leaves_no_ckpt_tmp(tmp_path):
    """Issue 53: a checkpoint's temporary file (rank0.ckpt.tmp) stayed behind a full disk."""
    run = tmp_path / "run"
    r = _with_small_files(f"""
        import torch
        from shmlearn.train import checkpoint
        try:
            checkpoint.save({str(run)!r}, 10, 0, 1, {{"w": torch.zeros(100_000)}})
        except OSError as e:
            print("refused", e.filename)
    """, 50_000, tmp_path)
    assert r.stdout.startswith("refused") and "rank0.ckpt" in r.stdout, r.stdout + r.stderr
    left = [str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()]
    assert left == [] and ckpt.candidates(str(run)) == []


def test_a_checkpoint_is_written_whole_and_read_back(tmp_path):
    import torch
    run = tmp_path / "run"
    ckpt.save(str(run), 10, 0, 1, {"w": torch.arange(5.0)})
    assert ckpt.candidates(str(run)) == [10]
    torch.testing.assert_close(ckpt.read_file(os.path.join(ckpt.step_dir(str(run), 10), "rank0.ckpt"))["w"],
                               torch.arange(5.0))
    assert sorted(p.name for p in (run / "checkpoints" / "step-00000010").iterdir()) == ["COMPLETE", "rank0.ckpt"]


def test_weights_on_a_full_disk_leave_no_temporary(tmp_path):
    r = _with_small_files("""
        import torch
        from shmlearn.record import weights
        from shmlearn.data.base import DataSpec
        net = torch.nn.Linear(300, 300)
        spec = DataSpec(name="t", task="classification", input_shape=(300,), num_outputs=300)
        try:
            weights.save(".", net, spec)
        except OSError as e:
            print("refused", e)
    """, 50_000, tmp_path)
    assert r.stdout.startswith("refused") and "model." in r.stdout, r.stdout + r.stderr
    assert list(tmp_path.iterdir()) == []


# -- the commands' own output: one line, the right exit code, nothing written before lost ----------

def _cli(args, cwd, limit=None):
    def small():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "shmlearn", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd, preexec_fn=small if limit else None)


def _one_line(r):
    return r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


@pytest.fixture
def report_run(tmp_path):
    from report.conftest import make_run  # the report tests' hand-made run directory
    run = tmp_path / "run"
    make_run(str(run))
    return run


def test_the_report_on_a_full_disk_is_one_line_and_keeps_the_earlier_report(report_run):
    (report_run / "report.html").write_text("the earlier report")
    r = _cli(["report", str(report_run)], report_run.parent, limit=20_000)
    assert r.returncode == 1 and _one_line(r) and "the disk is full" in r.stderr, r.stderr
    assert (report_run / "report.html").read_text() == "the earlier report"
    assert not [p for p in report_run.rglob("*") if ".tmp." in p.name]


def test_the_report_into_a_read_only_folder_or_onto_a_directory_is_one_line_exit_2(report_run, tmp_path,
                                                                                   monkeypatch, capfd):
    from cli_inproc import run_main
    # A folder this process cannot write: a read-only one, or (root writes those) /sys, which
    # refuses new files to root too.
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    where = ro if os.geteuid() != 0 else "/sys"
    try:
        r = run_main(["report", str(report_run), "--out", os.path.join(where, "r.html")], monkeypatch, capfd)
        assert r.returncode == 2 and _one_line(r) and os.path.join(where, "r.html") in r.stderr, r.stderr
    finally:
        ro.chmod(0o755)
    assert not os.path.exists(os.path.join(where, "r.html"))
    r = run_main(["report", str(report_run), "--out", str(tmp_path)], monkeypatch, capfd)
    assert r.returncode == 2 and _one_line(r) and "a directory" in r.stderr, r.stderr


def test_simulate_on_a_full_disk_is_one_line_and_keeps_the_earlier_output(tmp_path):
    compute = os.path.join(os.path.dirname(__file__), "..", "..", "results", "simulate-compute-cpu-alexnet-small.json")
    if not os.path.exists(compute):
        pytest.skip("committed measurement missing")
    out = tmp_path / "sim"
    out.mkdir()
    (out / "simulate.json").write_text('{"earlier": true}')
    # The JSON (a few kB) fits; the PNG (~60 kB) does not.
    r = _cli(["simulate", "--net-bw", "10", "--compute", compute, "--workers", "1,2,4", "--out", str(out)],
             tmp_path, limit=30_000)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "simulate.png" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "predictions" in json.loads((out / "simulate.json").read_text())  # written whole before the PNG
    assert sorted(p.name for p in out.iterdir()) == ["simulate.json"]


def test_a_temporary_file_left_by_an_interrupt_before_its_block_is_removed_on_the_way_out(tmp_path):
    """The fault campaign's int-sweep-report: a Ctrl-C right after a temporary file's create, before
    the block that removes it on an error, left figures/*.png.tmp.* behind. The program's Ctrl-C
    path removes what this process created and neither renamed nor removed; finished writes stay."""
    from shmlearn.record import safe_write as sw
    sw.write(str(tmp_path / "kept.json"), "{}")
    fd, tmp = sw._temp(str(tmp_path / "figure.png"))  # created, as the interrupt finds it
    os.close(fd)
    assert os.path.exists(tmp)
    sw.discard_unfinished()
    assert sorted(os.listdir(tmp_path)) == ["kept.json"]
    assert not sw._PENDING


def test_ctrl_c_in_a_command_removes_its_unfinished_temporary_files(tmp_path, capsys):
    """exits.guarded: a KeyboardInterrupt escaping the command discards the unfinished temporaries."""
    from shmlearn.cli import exits
    from shmlearn.record import safe_write as sw

    def command():
        fd, _ = sw._temp(str(tmp_path / "report.html"))
        os.close(fd)
        raise KeyboardInterrupt
    assert exits.guarded(command, ["sweep"]) == 130
    assert os.listdir(tmp_path) == []
