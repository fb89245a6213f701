"""What a case wrote, and what it must not have touched: torn or out-of-order JSONL rows, torn
JSON, temporary files left behind, and digests of folders (a run directory that must stay as it
was; the sentinel folder outside --out that nothing may change)."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional


def jsonl_problems(path: str, *, key: str = "step", torn_ok: bool = True) -> List[str]:
    """Unparseable lines (a torn LAST line is a kill's, and allowed) and steps out of order."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.decode(errors="replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    probs, prev = [], None
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if not (torn_ok and i == len(lines) - 1 and not raw.endswith(b"\n")):
                probs.append(f"{os.path.basename(path)} line {i + 1} is not JSON")
            continue
        if key and key in row:
            if prev is not None and row[key] <= prev:
                probs.append(f"{os.path.basename(path)} line {i + 1}: {key} {row[key]} after {prev}")
            prev = row[key]
    return probs


def run_dir_problems(out: str) -> List[str]:
    probs = jsonl_problems(os.path.join(out, "metrics.jsonl")) + jsonl_problems(os.path.join(out, "eval.jsonl"))
    for name in ("summary.json", "trace.json"):
        p = os.path.join(out, name)
        if os.path.exists(p):
            try:
                with open(p) as f:
                    json.load(f)
            except ValueError:
                probs.append(f"{name} is torn")
    if os.path.isdir(out):
        probs += [f"{n} left behind" for n in os.listdir(out) if n.startswith(("summary.json.tmp", "trace.json.tmp"))]
    return probs


def summary(out: str) -> Dict[str, Any]:
    """The run's summary.json; {} where there is none, or what is there is no object (a case
    that damaged it on purpose)."""
    try:
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
    except (OSError, ValueError):
        return {}
    return s if isinstance(s, dict) else {}


def completed(out: str) -> List[str]:
    s = summary(out)
    if s.get("status") != "completed" or s.get("steps") != s.get("planned_steps"):
        return [f"{out}: not completed ({s.get('status')}, {s.get('steps')}/{s.get('planned_steps')} steps)"]
    return []


def rows(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]



def sha(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return None


def digest(root: str) -> Dict[str, str]:
    """Every entry under `root`, symlinks not followed: a file by its bytes' hash and mode, a
    link by its target, a folder by its mode, a FIFO as such (never opened: it would block)."""
    import stat
    out: Dict[str, str] = {}
    if not os.path.lexists(root):
        return out
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = f"dir:{st.st_mode:o}"
            elif stat.S_ISREG(st.st_mode):
                out[rel] = f"file:{st.st_mode:o}:{sha(p)}"
            else:
                out[rel] = f"special:{st.st_mode:o}"
    return out


def changes(before: Dict[str, str], after: Dict[str, str], *, added_ok: bool = False) -> List[str]:
    """What differs between two digests: changed or removed entries (and added ones unless
    `added_ok`: a run directory gains a report, the sentinel gains nothing)."""
    out = [f"{k} changed" for k in sorted(before) if k in after and after[k] != before[k]]
    out += [f"{k} removed" for k in sorted(before) if k not in after]
    if not added_ok:
        out += [f"{k} created" for k in sorted(after) if k not in before]
    return out


SENTINEL_FILES = {"notes.txt": "a user's file beside the run\n", "metrics.jsonl": '{"step": 0, "loss": 1.0}\n',
                  "config.yaml": "lr: 0.1\n", "summary.json": '{"status": "completed"}\n', ".lock": "",
                  "report.html": "<p>mine</p>\n"}
"""The sentinel folder outside every case's --out: files a symlink in --out may point at."""


def make_sentinel(path: str) -> str:
    os.makedirs(os.path.join(path, "dir"), exist_ok=True)
    for n, text in SENTINEL_FILES.items():
        with open(os.path.join(path, n), "w") as f:
            f.write(text)
    return path


def tmp_leftovers(root: str) -> List[str]:
    """Temporary files a failed write left behind (name.tmp, name.ckpt.tmp, .tmpXXXX)."""
    out = []
    for d, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) + " left behind" for n in files
                if n.endswith(".tmp") or ".tmp." in n or n.startswith(".tmp")]
    return out


def json_of(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
