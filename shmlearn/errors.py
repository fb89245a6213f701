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


def count(n: int, noun: str) -> str:
    """A count in a message: '1 worker', '2 workers' (nouns with a plain -s plural)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one line of a message: 'RuntimeError: the first line of its text'."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def user_frame(e: BaseException) -> str:
    """Where in the user's own code `e` was raised: ' (at FILE:LINE in NAME)' for the innermost
    frame outside shmlearn, torch and the standard library, or '' when there is none. A one-line
    error from a worker then still points at the user's line (the full traceback goes to the
    worker's log)."""
    import os
    import sysconfig
    import traceback
    skip = tuple(os.path.realpath(p) + os.sep for p in
                 {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                  sysconfig.get_paths()["platlib"], os.path.dirname(os.path.abspath(__file__))})
    found = ""
    for fs in traceback.extract_tb(e.__traceback__):
        path = os.path.realpath(fs.filename)
        if not path.startswith(skip) and not fs.filename.startswith("<"):
            found = f" (at {fs.filename}:{fs.lineno} in {fs.name})"
    return found
