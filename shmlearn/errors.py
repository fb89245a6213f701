"""The three ways a run ends badly, each with its own CLI exit code (docs/architecture.md,
"The output contract"), and how their messages say a count."""


class BadInput(Exception):
    """Input the user can fix: a flag, file or value. Exit code 2, one line, no traceback.

    The message must name the flag, file or value and say what is expected.
    """

    exit_code = 2


class Diverged(Exception):
    """The loss went NaN/inf. Exit code 3; the message names the step and the rank that saw it first."""

    exit_code = 3

    def __init__(self, message: str, *, step: int, rank: int):
        super().__init__(message)
        self.step = step
        self.rank = rank


class WorkerFailed(Exception):
    """A worker died, hung or raised. Exit code 1; the message names the rank and why."""

    exit_code = 1


class WriteFailed(WorkerFailed):
    """An output file could not be written (a full disk, an I/O error): exit code 1, one line
    naming the file (safe_write.cli_output); what was written before is kept."""


def count(n: int, noun: str) -> str:
    """A count in a message: '1 worker', '2 workers' (nouns with a plain -s plural)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one line of a message: 'RuntimeError: the first line of its text'."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"



def _user_frames(e: BaseException) -> list:
    """The frames of `e`'s traceback in the user's own files: outside shmlearn, torch, the
    standard library and installed packages (and not `<string>`-like code)."""
    import os
    import sysconfig
    import traceback
    paths = sysconfig.get_paths()
    skip = tuple(os.path.realpath(p) + os.sep for p in
                 {paths["stdlib"], paths["purelib"], paths["platlib"], os.path.dirname(os.path.abspath(__file__))})
    return [fs for fs in traceback.extract_tb(e.__traceback__)
            if not fs.filename.startswith("<") and not os.path.realpath(fs.filename).startswith(skip)]


def user_frame(e: BaseException) -> str:
    """Where in the user's own code `e` was raised: ' (at FILE:LINE in NAME)' for the innermost
    such frame, or '' when there is none: a one-line BadInput still points at the user's line."""
    frames = _user_frames(e)
    return f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""


def user_traceback(e: BaseException) -> str:
    """The user's frames of `e` as Python prints them ('  File "model.py", line 12, in forward' and
    the line), '' when none: what a worker's failure adds below its one line, so the user sees their
    own code, not the library's frames."""
    import traceback
    frames = _user_frames(e)
    return "".join(traceback.format_list(frames)).rstrip("\n") if frames else ""
