"""How the `shmlearn` program ends when a command does not return: Ctrl-C, a hangup, a reader that
closed our stdout, an OS error. Each is one line on stderr and its exit code (cli.entry wraps every
command in `guarded`):

* Ctrl-C: 130, however many times it is pressed. The first raises KeyboardInterrupt where the
  program is (imports, the pool's start, training), so the pool ends its workers, the run's files
  are closed and a study gives its trials back; a second one lets that cleanup finish (it was a
  KeyboardInterrupt inside it, a traceback and exit -2), or, where no KeyboardInterrupt is being
  handled (Python dropped the first, raised inside a finalizer), is the first; a third leaves at
  once (os._exit). The line starts on a line of its own (a progress bar may be open).
* SIGHUP (the terminal or ssh session closed): the same path as Ctrl-C, exit 129.
* BrokenPipeError (`shmlearn ... | head -1`): 1; stdout points at /dev/null from then on, so the
  interpreter's exit does not fail on it a second time.
* any other OSError: 1, naming the file where the error has one.
* a BadInput raised outside the command's own handler (a strategy file that raises at import,
  imported while the parser is built): its line, exit 2.

Imports nothing of torch's: a Ctrl-C while torch imports is handled too.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable, List

from shmlearn.errors import BadInput, one_line
from shmlearn.record import safe_write


class Hangup(KeyboardInterrupt):
    """SIGHUP, raised where the program is, so that it unwinds as Ctrl-C does."""


_interrupts = 0
"""Ctrl-Cs and hangups received."""
_said = False
"""Whether this process has printed its interrupted line."""
_finished = False
"""Whether the command has returned (finishing): a Ctrl-C from then on leaves at once."""
_argv: List[str] = []
"""The command line guarded() runs (for the line of a second Ctrl-C)."""


def _unwinding() -> bool:
    """Whether the code a signal interrupted is handling a KeyboardInterrupt (an except or
    finally block on its way out, or code those call): the exception it handles, or one that
    exception was raised while handling, is one."""
    e = sys.exc_info()[1]
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__context__
    return False


RECHECK_S = (0.2, 0.3, 0.5, 1.0)
"""Pauses (seconds) after a first Ctrl-C before each check that the program is handling it: Python
prints and drops a KeyboardInterrupt raised inside a finalizer (__del__, a weakref callback;
torch's import runs many), and the command went on (a run stopped 0.5 s after its start trained
to its end, exit 0). Where no KeyboardInterrupt is being handled, it is raised again."""
_recheck = False
"""Set by the recheck thread just before it interrupts the main thread: that signal is ours."""


def _recheck_later(signum: int) -> None:
    import _thread
    import threading
    import time

    def run() -> None:
        global _recheck
        for pause in RECHECK_S:
            time.sleep(pause)
            if _said or _finished:
                return
            _recheck = True
            _thread.interrupt_main(signum)
    threading.Thread(target=run, name="shmlearn-ctrl-c-recheck", daemon=True).start()


def _on_signal(signum, frame) -> None:
    global _interrupts, _recheck
    if _recheck:  # the recheck of a first Ctrl-C (_recheck_later), not one more press
        _recheck = False
        if _said or _finished or _unwinding():
            return
        raise Hangup() if signum == signal.SIGHUP else KeyboardInterrupt()
    _interrupts += 1
    if _interrupts == 1:
        _recheck_later(signum)
    if _interrupts == 2 and not _finished:
        if _unwinding():
            # The first one's cleanup is under way (the pool ends its workers, a study gives its
            # trials back): let it finish.
            return
        # The first one was lost: raised inside a finalizer (__del__, a weakref callback: torch's
        # import runs many), where Python prints and drops an exception, so the command went on
        # (a run at 0.5 s trained to its end, exit 0). This one is the first.
        _interrupts = 1
        raise Hangup() if signum == signal.SIGHUP else KeyboardInterrupt()
    if _interrupts > 1:  # pressed again: leave now, without a traceback
        code = 129 if signum == signal.SIGHUP else 130
        if not _said:
            code = interrupted(_argv, hangup=signum == signal.SIGHUP)
        _flush_quietly()
        safe_write.discard_unfinished()
        os._exit(code)
    raise Hangup() if signum == signal.SIGHUP else KeyboardInterrupt()


def install() -> None:
    """Ctrl-C and SIGHUP as described above, for this process (the program's, never a library
    caller's: only cli.entry calls it). Where SIGINT is ignored (started in the background by a
    shell without job control, nohup) it stays ignored."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _on_signal)


def finishing() -> None:
    """The command has returned: a Ctrl-C during the exit's cleanup (the pool's close, the
    forkserver's end) leaves at once with 130, without a traceback from an atexit callback."""
    global _interrupts, _finished
    _interrupts = max(_interrupts, 1)
    _finished = True


def _flush_quietly() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _bar_open() -> bool:
    """Whether a tqdm bar is drawn on the terminal now (no newline after it yet)."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    return bool(getattr(tqdm, "_instances", None))


def _say(line: str, own_line: bool = False) -> None:
    """line on stderr, after a newline where a progress bar may be open: this process's (tqdm's),
    or, own_line, one that rank 0's worker process draws on the same stderr."""
    try:
        print(("\n" if own_line or _bar_open() else "") + line, file=sys.stderr, flush=True)
    except (OSError, ValueError, RuntimeError):  # RuntimeError: a reentrant write from a signal handler
        pass


def interrupted(argv: List[str], hangup: bool = False) -> int:
    """The line and exit code of an interrupted command (every interrupt's way out): the temporary
    files it left unfinished are removed first."""
    global _said
    safe_write.discard_unfinished()
    what = "hangup (SIGHUP)" if hangup else "interrupted (Ctrl-C)"
    if _said:
        return 129 if hangup else 130
    _said = True
    hint = ""
    training = argv[:1] == ["train"] and not any(a in ("-h", "--help") for a in argv)
    if training:
        hint = ("; the workers were stopped; run the same command with --resume to continue the run "
                "from its last checkpoint (--checkpoint-every)")
    elif argv[:1] == ["sweep"]:
        hint = "; the same command continues the sweep"
    _say(f"shmlearn: {what}{hint}", own_line=training and "--no-progress" not in argv)
    return 129 if hangup else 130


def _stdout_to_devnull() -> None:
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass


def guarded(command: Callable[[], int], argv: List[str]) -> int:
    """command()'s exit code, or the one line and exit code of what escaped it (see above)."""
    global _argv
    _argv = list(argv)
    try:
        return command()
    except KeyboardInterrupt as e:
        return interrupted(argv, hangup=isinstance(e, Hangup))
    except BadInput as e:  # raised where the command's own handler does not reach (an import)
        _say(f"shmlearn: error: {e}")
        return e.exit_code
    except BrokenPipeError:
        _stdout_to_devnull()
        _say("shmlearn: stdout was closed by its reader (broken pipe); the rest of the output was dropped")
        return 1
    except OSError as e:
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        _say(f"shmlearn: failed: {e.strerror or one_line(e)}{where}")
        return 1
