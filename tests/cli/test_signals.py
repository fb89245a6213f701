"""The program's end when a command does not return (exits.py): Ctrl-C at any phase is one line and
130, however many times it is pressed; SIGHUP is 129 with the workers ended; a reader that closes
stdout and an OSError are one line. The signals go to the program's whole process group, as a
terminal sends them."""
import os
import signal
import subprocess
import sys
import time

import pytest

from procs import alive

TRAIN = ["train", "--epochs", "1000", "--eval-points", "1"]  # ~15 s of training: it is still running when signalled


def start(tmp_path, *args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "SHMLEARN_"))
         and k not in ("RANK", "WORLD_SIZE")}
    e.update(PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "shmlearn", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e, cwd=str(tmp_path), start_new_session=True)


def signal_group(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def children(pid: int):
    """Pids of the processes in pid's session (its workers, the forkserver), pid excluded."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != pid:
            try:
                if os.getsid(int(d)) == pid:
                    found.append(int(d))
            except OSError:
                pass
    return found


def finish(p, timeout=240):
    out, err = p.communicate(timeout=timeout)
    deadline = time.monotonic() + 30  # the workers die with their owner (pidfd watch): give them a moment
    while children(p.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [c for c in children(p.pid) if alive(c)]
    for c in left:
        os.kill(c, signal.SIGKILL)
    return p.returncode, out, err, left


def wait_for(path, p, timeout=240):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
        time.sleep(0.1)


@pytest.mark.parametrize("when", ["imports", "workers"])
def test_ctrl_c_during_start_up_is_one_line_and_130(tmp_path, when):
    """Ctrl-C while the program imports torch (0.5 s in), or once its workers exist (before or as
    training starts: 2 workers on 2 cores fork from the program within ~2 s now): one line, 130,
    no worker left. The progress bar's own lines (`train: ...`), if training began, are not junk."""
    p = start(tmp_path, *TRAIN, "--out", "run")
    if when == "imports":
        time.sleep(0.5)
    else:
        deadline = time.monotonic() + 120
        while not children(p.pid) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    signal_group(p, signal.SIGINT)
    code, out, err, left = finish(p)
    if code == 0:
        pytest.skip("the run finished before the signal (a very fast machine)")
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith("train:")]
    assert len(lines) == 1 and lines[0].startswith("shmlearn: interrupted"), err
    assert not left


def test_ctrl_c_twice_in_training_is_130_with_one_line_saying_resume_continues(tmp_path):
    p = start(tmp_path, *TRAIN, "--checkpoint-every", "50", "--out", "run")
    wait_for(str(tmp_path / "run" / "metrics.jsonl"), p)
    signal_group(p, signal.SIGINT)
    time.sleep(0.05)
    signal_group(p, signal.SIGINT)
    code, out, err, left = finish(p)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("shmlearn: interrupted") and "--resume" in last, err[-2000:]
    assert not left


def test_sighup_to_a_training_run_is_129_and_ends_its_workers(tmp_path):
    p = start(tmp_path, *TRAIN, "--no-progress", "--out", "run")
    wait_for(str(tmp_path / "run" / "metrics.jsonl"), p)
    os.kill(p.pid, signal.SIGHUP)  # the program only: its workers must end with it
    code, out, err, left = finish(p)
    assert code == 129, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("shmlearn: hangup"), err
    assert not left


def test_a_closed_stdout_is_one_line_not_a_traceback(tmp_path):
    """`shmlearn simulate ... | head -1`: the reader leaves after its first line (`true`: before any)."""
    one = subprocess.run([sys.executable, "-m", "shmlearn", "train", "--workers", "1", "--samples", "640",
                          "--no-progress", "--eval-points", "1", "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-2000:]
    for reader in ("head -1", "true"):
        r = subprocess.run(f"{sys.executable} -m shmlearn simulate --compute one --net-bw 10 | {reader} >/dev/null; "
                           f"exit ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", capture_output=True,
                           text=True, timeout=240, cwd=str(tmp_path))
        assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "broken pipe" in r.stderr


def test_ctrl_c_in_a_model_import_that_never_ends_is_one_line_and_130(tmp_path):
    (tmp_path / "forever.py").write_text("import time\nwhile True:\n    time.sleep(0.05)\n")
    p = start(tmp_path, "train", "--model", "forever.py:Net", "--samples", "2000", "--no-progress", "--out", "run")
    time.sleep(12)  # torch imported, the model's import under way (if not, it is still one Ctrl-C)
    signal_group(p, signal.SIGINT)
    code, out, err, left = finish(p)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not left



LOST_FIRST = r"""
import os, signal, sys
from shmlearn.cli import exits
exits.install()


class Finalized:
    def __del__(self):  # the first Ctrl-C lands here: raised inside a finalizer, Python drops it
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000):
            pass


def command():
    Finalized()
    print("the first was lost", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10 ** 7):
        pass
    print("the second was ignored too", flush=True)
    return 0


sys.exit(exits.guarded(command, ["sweep"]))
"""


def test_a_second_ctrl_c_after_a_first_that_python_dropped_stops_the_command(tmp_path):
    """The campaign's int-train-w1-at-0.5s-twice: a Ctrl-C that lands in a finalizer (torch's import
    runs many) is printed and dropped by Python; the second was then taken for one during the
    first's cleanup and ignored too, and the run trained to its end, exit 0."""
    r = subprocess.run([sys.executable, "-c", LOST_FIRST], capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, (r.stdout, r.stderr)
    assert r.stdout == "the first was lost\n", r.stdout
    assert r.stderr.strip().splitlines()[-1] == "shmlearn: interrupted (Ctrl-C); the same command continues the sweep"


def test_a_single_ctrl_c_that_python_dropped_still_stops_the_command():
    """The campaign's int-train-w1-at-0.5s (2 runs in 9): the one Ctrl-C landed in a finalizer and
    the run trained to its end, exit 0. The program checks that it is handling it, and raises it
    again where it is not."""
    one = LOST_FIRST.replace('    os.kill(os.getpid(), signal.SIGINT)\n    for _ in range(10 ** 7)',
                             '    for _ in range(10 ** 8)')
    assert one != LOST_FIRST
    r = subprocess.run([sys.executable, "-c", one], capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, (r.stdout, r.stderr)
    assert r.stdout == "the first was lost\n", r.stdout
    assert r.stderr.strip().splitlines()[-1] == "shmlearn: interrupted (Ctrl-C); the same command continues the sweep"
