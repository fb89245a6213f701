"""Sizes follow concerns (issue 54): every file under shmlearn/ stays under 600 lines and every class
under 300, and none gets there by squeezing: no line holds two statements (`a; b`) or a compound
statement with its body (`if x: y`, `finally: z`). A file or class that grows past its limit is split
where its concerns part (DESIGN.md, Style).

Files are read with `ast`; nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import shmlearn

ROOT = Path(shmlearn.__file__).resolve().parent
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300


def _sources() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT.parent).as_posix(), p.read_text()) for p in sorted(ROOT.rglob("*.py"))]


def too_long(name: str, src: str) -> list[str]:
    """'file: N lines' and 'file:line class C: N lines' for each limit src reaches (a class counts
    from its first decorator to its last line)."""
    out = []
    n = len(src.splitlines())
    if n >= MAX_FILE_LINES:
        out.append(f"{name}: {n} lines (limit: under {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(src, name)):
        if isinstance(node, ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            size = node.end_lineno - first + 1
            if size >= MAX_CLASS_LINES:
                out.append(f"{name}:{node.lineno} class {node.name}: {size} lines (limit: under {MAX_CLASS_LINES})")
    return out


def joined(name: str, src: str) -> list[str]:
    """'file:line: ...' of each statement that does not start its own line: one after `;`
    (`a; b`) or a body on its compound statement's line (`if x: y`, `finally: y`, `def f(): y`)."""
    lines = src.splitlines()
    out = []
    for node in ast.walk(ast.parse(src, name)):
        if not isinstance(node, ast.stmt):
            continue
        before = lines[node.lineno - 1].encode()[:node.col_offset].decode(errors="replace").strip()  # col: bytes
        if before:
            out.append(f"{name}:{node.lineno}: a statement after `{before[-20:]}` on its line")
    return sorted(set(out), key=lambda m: int(m.split(":")[1]))


def test_files_and_classes_stay_under_their_limits():
    bad = [msg for name, src in _sources() for msg in too_long(name, src)]
    assert not bad, "split these where their concerns part (DESIGN.md, Style):\n" + "\n".join(bad)


def test_no_line_is_squeezed():
    bad = [msg for name, src in _sources() for msg in joined(name, src)]
    assert not bad, "one statement a line (lines are not joined to meet a size limit):\n" + "\n".join(bad)


def test_the_checkers_see_what_they_check():
    long_class = "class C:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 1)
    assert too_long("m.py", long_class) == [f"m.py:1 class C: {MAX_CLASS_LINES} lines (limit: under {MAX_CLASS_LINES})"]
    assert too_long("m.py", "class C:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 2)) == []
    assert too_long("m.py", "x = 1\n" * MAX_FILE_LINES) == [f"m.py: {MAX_FILE_LINES} lines (limit: under {MAX_FILE_LINES})"]
    src = ("a = 1; b = 2\n"
           "if a: b = 3\n"
           "try:\n    pass\nfinally: b = 4\n"
           "def f(x,\n      y): return x\n"
           "def g():\n    return 1\n"
           "if a:\n    pass\nelse:\n    b = 5\n"
           "class C: pass\n")
    assert [m.split(": ", 1)[0] for m in joined("m.py", src)] == ["m.py:1", "m.py:2", "m.py:5", "m.py:7", "m.py:14"]
    assert joined("m.py", "x = 'é'; y = 1\n") == ["m.py:1: a statement after `x = 'é';` on its line"]
