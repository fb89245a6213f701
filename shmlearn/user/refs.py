"""The user's own code, named on the command line: `FILE.py:NAME` or `pkg.module:NAME`.

`--model my_net.py:Net` and `--dataset pkg.data:load` name a class or callable the way uvicorn and
gunicorn name an app. Each process imports it itself (a spawned worker, a torchrun rank), so
nothing has to be pickled; the reference string is what config.yaml records, so a run directory
says how to run it again.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any

from shmlearn.user import user_main
from shmlearn.errors import BadInput


def is_ref(text: str) -> bool:
    """A reference, not a registered name: 'x.py:Net' or 'pkg.mod:Net' (names never hold ':')."""
    return isinstance(text, str) and ":" in text and not text.startswith(":") and not text.endswith(":")


def load_ref(ref: str, flag: str) -> Any:
    """The object `ref` names; BadInput with one line (naming `flag`) when the file or module
    cannot be found or imported, or lacks NAME."""
    where, _, name = ref.rpartition(":")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _load_file(where, ref, flag)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise BadInput(f"{flag} {ref}: no module named {e.name!r} (a file needs the .py suffix: "
                           f"path/to/file.py:NAME)") from None
        except Exception as e:  # noqa: BLE001 - the user's module failed while importing
            raise BadInput(f"{flag} {ref}: importing {where} raised {_one_line(e)}") from None
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            have = sorted(n for n, v in vars(module).items() if not n.startswith("_")
                          and getattr(v, "__module__", None) == module.__name__)[:12]
            raise BadInput(f"{flag} {ref}: {where} has no {name!r}"
                           + (f" (it has {', '.join(have)})" if have else ""))
        obj = getattr(obj, part)
    return obj


def _load_file(path: str, ref: str, flag: str):
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise BadInput(f"{flag} {ref}: file {path} does not exist")
    # One module per file and process, under a stable name: a second load (the next sweep trial)
    # reuses it, and the file's own imports of its neighbours work as they would in a script.
    mod_name = "shmlearn_user_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, full)
    if spec is None or spec.loader is None:
        raise BadInput(f"{flag} {ref}: {path} cannot be imported as Python (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    folder = os.path.dirname(full)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        # A script that trains at module level is run up to its shmlearn.train call, as a pool
        # worker runs it (user_main.py): what it defines before the call is what NAME refers to.
        with user_main.importing():
            spec.loader.exec_module(module)
    except user_main.MainStop:
        pass
    except KeyboardInterrupt:  # Ctrl-C during an import that takes long (or never ends): the user's stop
        sys.modules.pop(mod_name, None)
        raise
    except BaseException as e:  # noqa: BLE001 - SyntaxError, the file's own errors, even SystemExit
        del sys.modules[mod_name]
        raise BadInput(f"{flag} {ref}: importing {path} raised {_one_line(e)}") from None
    return module


def call_user(fn, args: tuple, what: str):
    """fn(*args) for a callable the user gave; anything it raises becomes one BadInput line
    naming `what` (the argument or flag) instead of a traceback from inside a worker."""
    try:
        return fn(*args)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise BadInput(f"{what}: {name}() raised {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
