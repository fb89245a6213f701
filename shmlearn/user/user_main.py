"""The user's script in a pool worker: imported up to its first `shmlearn.train(...)` call.

A pool worker must import the script that started the pool (multiprocessing does, as
`__mp_main__`): the classes and functions the script passes to `shmlearn.train` travel pickled by
reference to `__main__`. multiprocessing runs the whole script there, so a script whose training
code sits at module level (pytorch/examples' scripts, a notebook exported to a file) trained again
inside every worker, and had to move under `if __name__ == "__main__":` first (issue 51: 61 lines of
the word-language-model port re-indented). Here the pool takes that import over: `Pool._spawn`
starts workers without multiprocessing's (`no_main_import`), and the worker runs the script itself
(`import_main`) under the same name, stopping where it calls `shmlearn.train`: everything the call
passes is defined by then. What ran before the call (argument parsing, reading the data) runs in
every worker, as it does in every rank under torchrun; what follows the call runs only in the
script's own process. A script with a main guard runs as before (the guard keeps its body out).
Where train()'s pool forks its workers from the script's process itself (launch/forkserver.py,
caller_fork: one intra-op thread a rank, torch._dynamo imported, no CUDA), nothing runs again: a
worker is a copy of that process at its train() call.
`--model FILE.py:NAME` and the like import a file the same way (refs.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from typing import Iterator, Optional, Tuple

_importing = False
"""True while this worker runs the user's script (import_main): shmlearn.train then stops it."""
_program = False
"""True in the `shmlearn` program (cli.main.entry): its __main__ is a console script or
shmlearn/__main__.py, never a script of the user's, and a console script without a main guard
would run the whole command again in every worker (a sweep's workers each ran the sweep)."""


def program_owns_main() -> None:
    """The `shmlearn` program is running: its workers import no script (main_reference)."""
    global _program
    _program = True


def in_program() -> bool:
    """Whether this process is the `shmlearn` program's own (program_owns_main), not a user's script."""
    return _program


class MainStop(BaseException):
    """Raised by shmlearn.train inside a worker's import of the script: the import ends there. A
    BaseException, so that a script's `except Exception` does not swallow it."""


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """While a file of the user's is run as an import (here, or refs.py's FILE.py:NAME), a
    shmlearn.train call in it raises MainStop."""
    global _importing
    before, _importing = _importing, True
    try:
        yield
    finally:
        _importing = before


def stop_if_importing() -> None:
    """train()'s first line (train/entry.py): in a worker importing the script, end the import here."""
    if _importing:
        raise MainStop()


def main_reference(init=None) -> Optional[Tuple[str, str]]:
    """("path", FILE) or ("name", MODULE) of the script a worker must import, as multiprocessing
    decides it (spawn.get_preparation_data), or None: no file (an interactive session, `python
    -c`, the `shmlearn` program's console script: main_file), or a package's __main__ (`python -m
    shmlearn`, `python -m pytest`), which multiprocessing never imports either; None too where the
    pool's init (fn, args) comes from the script, which the worker unpickles before it could run
    the script: multiprocessing imports it then."""
    if getattr(init[0] if init else None, "__module__", "") == "__main__":
        return None
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else ("name", name)
    path = main_file()
    if path is None:
        return None
    from multiprocessing import process
    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None:
        path = os.path.join(process.ORIGINAL_DIR, path)
    return "path", os.path.normpath(path)


def main_file() -> Optional[str]:
    """The file of the script `__main__` runs, as the process has it, or None where there is no file
    a worker could import: an interactive session, `python -c`, and `python -` (a script read from
    stdin, whose __file__ is '<stdin>'), and the `shmlearn` program's own script (program_owns_main)."""
    if _program:
        return None
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or (path.startswith("<") and path.endswith(">")):
        return None
    return path


@contextlib.contextmanager
def no_main_import() -> Iterator[None]:
    """Start processes whose multiprocessing bootstrap does not import the script (the worker does:
    import_main). The preparation data multiprocessing sends a new process loses its two keys."""
    from multiprocessing import spawn
    original = spawn.get_preparation_data

    def prepared(name):
        d = original(name)
        d.pop("init_main_from_path", None)
        d.pop("init_main_from_name", None)
        return d
    spawn.get_preparation_data = prepared
    try:
        yield
    finally:
        spawn.get_preparation_data = original


def import_main(ref: Optional[Tuple[str, str]]) -> None:
    """In a worker: run the script as `__mp_main__` (and `__main__`, as multiprocessing aliases it),
    up to its first shmlearn.train call. What it raises before then is raised here, as
    multiprocessing's own import would have."""
    if ref is None:
        return
    kind, where = ref
    if kind == "path":
        path, spec = where, None
    else:
        spec = importlib.util.find_spec(where)
        if spec is None or spec.origin is None:
            return
        path = spec.origin
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    module.__spec__ = spec
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    try:
        with importing():
            exec(code, module.__dict__)
    except MainStop:
        pass
