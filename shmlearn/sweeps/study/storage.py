"""Where a study lives: Optuna storages opened from a URL, with what shmlearn adds to them.

open_storage takes an RDB URL or journal:PATH. The journal file is Optuna's JournalFileBackend
with its torn last line mended (jsonl.py) and a full disk said in one line; unwritable finds a
storage's full disk in any exception chain (SQLite's 'database or disk is full'). study.py runs
the study; this module is only the storage, so that study.py stays about trials.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import optuna
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from shmlearn.record import jsonl
from shmlearn.errors import BadInput


def redact(url: str) -> str:
    """The URL with its password hidden (it goes into messages and sweep.json)."""
    if url.startswith("journal:"):
        return url
    try:
        from sqlalchemy.engine import make_url
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL at all: the open fails and says so
        return url


def why_not_opened(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    why = f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
    if isinstance(e, ImportError) and e.__cause__ is not None:  # optuna's says which module only here
        why += f": {e.__cause__}"
    return why


class _Journal(JournalFileBackend):
    """Optuna's journal file, whose torn last line (a kill or a full disk mid-write) is mended
    before every append and at open, under the journal's own lock (jsonl.py), and whose append
    that fails on a full disk leaves the file as it was and says so in one line (BadInput).
    Optuna's own backend appends after the torn bytes: one bad line for good, every study in the
    file unreadable."""

    def __init__(self, path: str, url: str):
        self._url = url
        self._file_lock = JournalFileSymlinkLock(path)
        super().__init__(path, lock_obj=self._file_lock)
        self.notes: List[str] = []
        self._locked(self._mend)

    def _locked(self, fn) -> None:
        self._file_lock.acquire()
        try:
            fn()
        except OSError as e:
            raise BadInput(self._full(e)) from None
        finally:
            self._file_lock.release()

    def _full(self, e: OSError) -> str:
        why = "the disk is full" if e.errno in jsonl.FULL else "cannot write it"
        return (f"--storage {self._url}: {why} ({e.strerror}); the study file is as it was before this write, "
                f"free space and run the same command again")

    def _mend(self) -> None:
        note = jsonl.mend(self._file_path)
        if note:
            self.notes.append(note)
            print(f"sweep: {note}", file=sys.stderr, flush=True)

    def append_logs(self, logs: List[Dict[str, Any]]) -> None:
        data = ("\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n").encode()
        self._locked(lambda: (self._mend(), jsonl.append_or_cut_back(self._file_path, data)))


def open_storage(url: str):
    """An RDB URL (sqlite:///PATH, postgresql://USER@HOST/DB, mysql://...) or journal:PATH."""
    if url.startswith("journal:"):
        path = url[len("journal:"):]
        path = path[2:] if path.startswith("//") else path  # journal:///abs/path
        d = os.path.dirname(os.path.abspath(path)) if path else ""
        if not path or os.path.isdir(path) or not os.path.isdir(d) or not os.access(d, os.W_OK):
            raise BadInput(f"--storage {url}: cannot open it (expected journal:FILE in a writable directory)")
        try:
            backend = _Journal(path, url)
            return optuna.storages.JournalStorage(backend)
        except BadInput:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to open is the user's URL or file
            raise BadInput(f"--storage {url}: cannot open it ({why_not_opened(e)})") from None
    engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else {}  # writers wait, not fail
    last: Optional[BaseException] = None
    for attempt in range(3):  # processes started together race to create the tables
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine)
        except (ImportError, ValueError) as e:  # no driver, or not a URL: no point retrying
            last = e
            break
        except Exception as e:  # noqa: BLE001
            last = e
            if "ArgumentError" in type(e).__name__ or "NoSuchModule" in type(e).__name__:
                break
            time.sleep(0.5 + attempt)
    raise BadInput(f"--storage {redact(url)}: cannot open it ({why_not_opened(last)})")


def unwritable(e: BaseException) -> Optional[str]:
    """Why a storage write failed, where it was the disk (SQLite's 'database or disk is full', its
    'disk I/O error' past a file size limit, a full disk's OSError) anywhere in e's chain; else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        for sign, why in (("database or disk is full", "the disk is full"),
                          ("disk I/O error", "cannot write it")):
            if sign in text:
                return f"{why} (SQLite: {sign})"
        if isinstance(e, OSError) and e.errno in jsonl.FULL:
            return f"the disk is full ({e.strerror})"
        e = e.__cause__ or e.__context__
    return None
