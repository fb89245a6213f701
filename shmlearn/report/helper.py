"""A sweep's report drawn by a helper process that loaded matplotlib while the sweep imported torch.

    sweep (cmd_sweep) --starts--> helper: imports matplotlib and the report, draws one small figure,
      |                           then waits on its stdin (no CPU while the trials train)
      '-- at the end: {"folder": DIR} --> write_report(DIR) --> {"path": ...} | {"oserror": ...} | ...

Why: the `shmlearn sweep` program's report needs matplotlib (~0.3 s of a core to import, ~0.1 s
more to draw its first figure), which the sweep loaded before its first trial: on a 2-core
machine, after the pool's workers were ready, the first trial waited for it. Started before the
sweep imports torch, the helper loads it on the core that import leaves idle. It needs no torch
(the report reads files), and a fresh interpreter of its own, so it is no fork of a process with
torch's threads; its figures are drawn side by side in copies of it (draw.py).

What the owner sees is what drawing in its own process gave: the path, or an OSError's text (a
full disk: the sweep says so and exits 1), or no matplotlib (a note). Anything else, or a helper
that died, returns None, and the owner draws the report itself, meeting the same error there. The
helper ignores Ctrl-C (its owner's cleanup ends it) and leaves when its stdin closes, also when the
owner was killed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, Dict, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The folder holding this shmlearn package: first on the helper's path, so it imports this copy."""


class ReportHelper:
    """The owner's side: start() at once, draw(folder) at the end, close() in any case."""

    def __init__(self) -> None:
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        # SHMLEARN_FORKSERVER=0: `import shmlearn` in it starts no forkserver (it runs no pool).
        env = dict(os.environ, PYTHONPATH=path, SHMLEARN_FORKSERVER="0")
        self.proc: Optional[subprocess.Popen] = subprocess.Popen(
            [sys.executable, "-m", "shmlearn.report.helper"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, text=True)

    def draw(self, folder: str) -> Optional[Dict[str, Any]]:
        """The helper's answer for write_report([folder]): {"path"}, {"oserror"} or {"importerror"};
        None where it failed otherwise or is gone (the caller then draws the report itself)."""
        if self.proc is None:
            return None
        try:
            self.proc.stdin.write(json.dumps({"folder": os.path.abspath(folder)}) + "\n")
            self.proc.stdin.flush()
            answer = json.loads(self.proc.stdout.readline() or "null")
        except (OSError, ValueError):
            answer = None
        return answer if isinstance(answer, dict) and not answer.get("failed") else None

    def close(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)  # it leaves at the end of its stdin
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start() -> Optional[ReportHelper]:
    """A helper, or None where one cannot start (the owner draws the report itself)."""
    try:
        return ReportHelper()
    except OSError:
        return None


def _warm() -> None:
    """Load matplotlib, the report and what it reads with, and draw one small figure of what the
    report draws (a colour bar, a legend, bar labels, texts of each size): each font size's first
    lookup and each kind's first draw cost a fresh process ~40 ms of its report, after the trials."""
    import importlib
    from shmlearn.report import mpl  # lazy: matplotlib, the point of this process
    importlib.import_module("shmlearn.report.pages")  # the page's modules, as write_report will
    importlib.import_module("yaml")  # the winners' config.yaml (record/readback imports it as it reads)
    fig, (ax, bx) = mpl.figure(4, 2, ncols=2)
    ax.plot([0, 1], [0, 1], marker="o", label="warm")
    ax.set(title="warm", xlabel="x", ylabel="y")
    ax.legend(fontsize=8)
    ax.annotate("6", (0, 0), fontsize=6)
    bx.bar_label(bx.barh([0], [1], hatch="///"), fontsize=7)
    fig.colorbar(bx.imshow([[0, 1]]), ax=bx, label="c")
    mpl.png(fig)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    try:
        _warm()
        missing = None
    except ImportError as e:
        missing = str(e)
    for line in sys.stdin:
        folder = json.loads(line)["folder"]
        if missing is not None:
            answer: Dict[str, Any] = {"importerror": missing}
        else:
            try:
                from shmlearn.report import write_report  # lazy: loaded by _warm (matplotlib) or not at all
                answer = {"path": write_report([folder])}
            except OSError as e:
                answer = {"oserror": str(e)}
            except Exception:  # noqa: BLE001 - the owner draws again and meets it itself
                answer = {"failed": True}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    # Its stdin closed: everything is written. Out without the interpreter's teardown of
    # matplotlib's modules (~0.2 s of a core, which its owner's exit waited for).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
