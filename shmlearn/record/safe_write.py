"""Every file shmlearn writes goes through here (docs/reliability.md, "Writing files").

Three rules, for a run's --out, a sweep's or study's folder, a report, simulate's and advise's output:

- **No symlink is followed out of the output folder.** A path whose real location (every
  symlinked part resolved) is outside the output folder's real location is refused before
  anything is written: BadInput (exit 2) naming the path and where it points. A planted
  `metrics.jsonl -> ~/.bashrc` is never truncated, `config.yaml -> /elsewhere` never created.
  The output folder itself may be a symlink: it is where the user asked the files to go.
- **A whole file is written atomically**: into a temporary file beside it (created with
  O_EXCL | O_NOFOLLOW, so never through a link), fsynced, then `os.replace`d over the name; a
  reader sees the old file or the new one, never half of one.
- **On any error the temporary file goes**, a full disk included, and the OSError names the
  file (a write error carries no path). An append-only log (metrics.jsonl, eval.jsonl, the
  sweep's results.jsonl, a folder's .lock) is opened with O_NOFOLLOW.

`cli_output` turns an OSError from a command's output into one line: exit 2 where the path
chosen cannot be written (read-only, a directory, a missing folder), exit 1 for a full disk.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
from contextlib import contextmanager
from typing import IO, Any, Iterator, Optional, Union

from shmlearn.errors import BadInput, WriteFailed

FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
"""The errnos of a full disk (EFBIG: a file past RLIMIT_FSIZE, as the tests make one; EDQUOT: a quota)."""

CHOSEN = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR, errno.ENOENT, errno.ELOOP,
          errno.EEXIST)
"""The errnos of a path the user chose that cannot be written: exit 2 in `cli_output`."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _inside(real: str, real_root: str) -> bool:
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def check(path: str, root: Optional[str] = None) -> None:
    """BadInput unless `path` lies inside `root` (default: its own folder) once every symlink on
    the way is resolved. The message names the first symlink that leads out and its target."""
    root = root if root is not None else (os.path.dirname(path) or ".")
    real_root = os.path.realpath(root)
    if _inside(os.path.realpath(path), real_root):
        return
    # Name the link: the first part of the path below root that is a symlink leading out.
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    probe = root
    for part in rel.split(os.sep):
        probe = os.path.join(probe, part)
        if os.path.islink(probe) and not _inside(os.path.realpath(probe), real_root):
            raise BadInput(f"{probe}: a symlink to {os.readlink(probe)}, outside {root}; shmlearn does not "
                           f"write through it (remove the link, or choose another output folder)")
    raise BadInput(f"{path}: resolves to {os.path.realpath(path)}, outside {root}; shmlearn does not "
                   f"write there (choose another output folder)")


def named(e: OSError, path: str) -> OSError:
    """`e` naming `path` where it names no file, or names our temporary file."""
    if e.filename is None or ".tmp." in os.path.basename(str(e.filename)):
        return OSError(e.errno, e.strerror, path)
    return e


_PENDING: set = set()
"""This process's temporary files not yet renamed or removed. A Ctrl-C that lands between the
file's creation and the block that removes it on an error (the create is the slow part, so the
signal's handler often runs right after it) would leave one behind: the program's Ctrl-C path
removes these (`discard_unfinished`; the fault campaign's int-sweep-report found one)."""


def _temp(path: str) -> tuple:
    """(fd, name) of a new temporary file beside `path`: PATH.tmp.<pid>.<random>, created with
    O_EXCL (a link in its place makes it fail, it is never followed) and mode 0666 & ~umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    while True:
        tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(3)}"
        _PENDING.add(tmp)  # before the create: the name is this process's alone
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            _PENDING.discard(tmp)
            continue
        except BaseException:  # interrupted once it was made: the caller never gets its name
            _remove(tmp)
            raise


def _remove(tmp: str) -> None:
    try:
        os.remove(tmp)
    except OSError:
        pass  # already gone, or the folder went away with it
    _PENDING.discard(tmp)  # after: an interrupt in between leaves it for discard_unfinished


def discard_unfinished() -> None:
    """Remove every temporary file this process created and neither renamed nor removed (the
    program calls it when a Ctrl-C ends a command)."""
    for tmp in list(_PENDING):
        _remove(tmp)


def fsync_dir(path: str) -> None:
    """fsync a folder, so that a rename in it survives a power cut; a folder that cannot be opened is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str, mode: str = "wb", *, root: Optional[str] = None, fsync: bool = True,
                sync_dir: bool = False) -> Iterator[IO]:
    """A file object to write `path` whole: the name gets the new content only when the block ends
    without an error; otherwise the temporary file is removed and `path` is as it was. mode "wb"
    or "w" (text, UTF-8). sync_dir: also fsync the folder after the rename (checkpoints)."""
    check(path, root)
    fd, tmp = _temp(path)
    with _committed(tmp, path):
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": ""})) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    if sync_dir:
        fsync_dir(os.path.dirname(path) or ".")


@contextmanager
def atomic_path(path: str, *, root: Optional[str] = None) -> Iterator[str]:
    """A temporary name to hand a writer that takes a path (safetensors' save_file); renamed to
    `path` when the block ends without an error, removed otherwise."""
    check(path, root)
    fd, tmp = _temp(path)
    os.close(fd)
    with _committed(tmp, path):
        yield tmp


@contextmanager
def _committed(tmp: str, path: str) -> Iterator[None]:
    """The temporary file `tmp` renamed over `path` when the block ends without an error; removed
    on any error (an OSError then names `path`, not the temporary)."""
    try:
        yield
        os.replace(tmp, path)
        _PENDING.discard(tmp)
    except OSError as e:
        _remove(tmp)
        raise named(e, path) from None
    except BaseException:
        _remove(tmp)
        raise


def write(path: str, data: Union[bytes, str], *, root: Optional[str] = None, fsync: bool = True) -> None:
    """`path` holds `data` (bytes, or text written as UTF-8), atomically."""
    with atomic_file(path, "wb", root=root, fsync=fsync) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_json(path: str, obj: Any, *, root: Optional[str] = None, indent: Optional[int] = 2, fsync: bool = True,
               **kw) -> None:
    """`path` holds `obj` as JSON, atomically (kw: json.dumps's, e.g. allow_nan=False)."""
    write(path, json.dumps(obj, indent=indent, **kw), root=root, fsync=fsync)


def sync(path: str) -> None:
    """fsync a file written without (`write(..., fsync=False)`), before it is published (a sweep's
    trial directory: record/runs.py `published`); a file that is not there is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_figure(fig, path: str, *, root: Optional[str] = None, **kw) -> None:
    """A matplotlib figure saved to `path` whole or not at all; the format is the path's
    extension (the temporary name has none); kw: savefig's (dpi=...)."""
    with atomic_file(path, "wb", root=root, fsync=False) as f:
        fig.savefig(f, format=os.path.splitext(path)[1][1:] or "png", **kw)


def finish_figure(fig, path: str, *, root: Optional[str] = None, **kw) -> str:
    """A pyplot figure laid out (tight_layout), saved whole or not at all (save_figure) and closed
    even when the save fails (pyplot keeps every open figure alive); returns path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    try:
        save_figure(fig, path, root=root, **kw)
    finally:
        plt.close(fig)
    return path


def makedirs(path: str, *, root: Optional[str] = None) -> None:
    """os.makedirs(path, exist_ok=True), refusing a symlinked part that leads out of `root`."""
    if root is not None:
        check(path, root)
    os.makedirs(path, exist_ok=True)


def open_log(path: str, *, root: Optional[str] = None, truncate: bool = False, binary: bool = False,
             read: bool = False) -> IO:
    """`path` opened to append (truncate: emptied first), never through a symlink (O_NOFOLLOW): a
    line-buffered text file, or binary. read: opened for reading too (a .lock's "a+")."""
    check(path, root)
    flags = (os.O_RDWR if read else os.O_WRONLY) | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC
    if truncate:
        flags |= os.O_TRUNC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link put there since `check`
            raise BadInput(f"{path}: a symlink; shmlearn does not write through it") from None
        raise named(e, path) from None
    if binary:
        return os.fdopen(fd, "ab+" if read else "ab")
    return os.fdopen(fd, "a+" if read else "a", buffering=1, encoding="utf-8")


def describe(e: OSError) -> str:
    """An OSError of a write as the end of one line: 'PATH: No space left on device'."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"


@contextmanager
def cli_output(what: str) -> Iterator[None]:
    """For a command's output (`what`: 'report', 'simulate', ...): an OSError while writing
    becomes one line. BadInput (exit 2) where the chosen path cannot be written; WriteFailed
    (exit 1) otherwise, a full disk included. Files written before are kept as they were."""
    try:
        yield
    except OSError as e:
        if e.errno in CHOSEN:
            raise BadInput(f"{what}: cannot write {describe(e)}; choose another output path") from None
        full = " (the disk is full)" if e.errno in FULL else ""
        raise WriteFailed(f"{what}: could not write {describe(e)}{full}; "
                          f"files written before are as they were") from None
