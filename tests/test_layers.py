"""The import graph of shmlearn has no cycles, counting imports inside functions.

Every module under shmlearn/ is parsed with `ast` (no import is run): each `import shmlearn.x`,
`from shmlearn.x import y` and relative `from .x import y` anywhere in the file, top level or inside a
function, is an edge; `from pkg import name` where `pkg.name` is a submodule is an edge to that
submodule. A strongly connected component of more than one module is a cycle and fails the test,
listed with the import lines that close it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import shmlearn

ROOT = Path(shmlearn.__file__).resolve().parent

def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every .py under shmlearn/ (a package is its __init__.py)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("shmlearn",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str | None:
    """The absolute module a `from ... import` names, or None when it is not shmlearn."""
    if node.level == 0:
        return node.module
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, dict[str, list[int]]]:
    """module -> {imported shmlearn module: [line numbers]}."""
    mods = _modules()
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in mods}

    def known(name: str) -> str | None:
        # `import shmlearn.a.b` names shmlearn.a.b; fall back to the longest known prefix
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "shmlearn"]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                if not base or base.split(".")[0] != "shmlearn":
                    continue
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                # `from pkg import sub, name`: an edge to each submodule, and to pkg for the rest
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            for t in targets:
                t = known(t)
                if t and t != mod:
                    graph[mod].setdefault(t, []).append(node.lineno)
    return graph


def _sccs(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    graph = import_graph()
    cycles = [c for c in _sccs(graph) if len(c) > 1]
    lines = []
    for comp in cycles:
        lines.append("cycle: " + ", ".join(comp))
        for m in comp:
            for t, at in sorted(graph[m].items()):
                if t in comp:
                    lines.append(f"    {m} -> {t} (line {', '.join(map(str, at))})")
    assert not cycles, "import cycles among shmlearn modules:\n" + "\n".join(lines)


def test_checker_sees_function_level_relative_and_submodule_imports():
    graph = import_graph()
    assert "shmlearn.sweeps.study.sweep" in graph["shmlearn.sweeps.cli"]  # inside run_sweep (defers optuna)
    assert "shmlearn.report.sweep_figures" in graph["shmlearn.report.pages"]  # from . import sweep_figures
    assert "shmlearn.sync.registry" in graph["shmlearn.config.train_config"]  # from shmlearn.sync import registry
    assert [sorted(c) for c in _sccs({"a": {"b": [1]}, "b": {"a": [2]}, "c": {"a": [3]}}) if len(c) > 1] == [["a", "b"]]


# Files whose function-level imports are not labelled yet (issue 40, item 1): none left.
NOT_YET_LABELLED: set[str] = set()


def function_level_imports(path: Path, mod: str) -> list[tuple[int, str]]:
    """(line, source) of each import of a shmlearn module inside a function of `path`, with the
    lines it spans joined, so a trailing comment on its last line is seen."""
    lines = path.read_text().splitlines()
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                ours = any(a.name.split(".")[0] == "shmlearn" for a in child.names)
            elif in_function and isinstance(child, ast.ImportFrom):
                ours = (_resolve(mod, is_pkg, child) or "").split(".")[0] == "shmlearn"
            else:
                ours = False
            if ours:
                out.append((child.lineno, " ".join(lines[child.lineno - 1:child.end_lineno])))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse("\n".join(lines), str(path)), False)
    return out


def _unlabelled() -> list[str]:
    bad = []
    for mod, path in _modules().items():
        rel = "shmlearn/" + path.relative_to(ROOT).as_posix()
        if any(rel == f or (f.endswith("/") and rel.startswith(f)) for f in NOT_YET_LABELLED):
            continue
        bad += [f"{rel}:{n}: {src.strip()}" for n, src in function_level_imports(path, mod)
                if "# lazy: " not in src]
    return bad


def test_function_level_imports_say_why():
    """A shmlearn import inside a function only defers a heavy optional dependency (Triton,
    Optuna, matplotlib, or torch before the CLI's cheap checks), and says which with a trailing
    `# lazy: <reason>`; every other one belongs at the top of its module (DESIGN.md, Style)."""
    bad = _unlabelled()
    assert not bad, "function-level shmlearn imports without `# lazy: <reason>`:\n" + "\n".join(bad)


def test_function_level_import_checker(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n"
                   "from shmlearn import errors\n"          # module level: not counted
                   "def f():\n"
                   "    import json\n"                       # not shmlearn: not counted
                   "    from shmlearn.config.train_config import (\n"
                   "        TrainConfig)  # lazy: torch\n"   # the comment on its last line counts
                   "    from . import tblog\n"               # relative: counted
                   "    import shmlearn.step.fast\n")
    found = function_level_imports(src, "shmlearn.m")
    assert [n for n, _ in found] == [5, 7, 8]
    assert ["# lazy: " in s for _, s in found] == [True, False, False]


# --- packages in layers ------------------------------------------------------------------------

LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    # leaves that import nothing above errors.py, used from below their package
    ("nn", "launch.parent", "step.summary", "train.noise", "sweeps.winners"),
    ("record",),                 # files: safe writes, readback, jsonl, timing, metrics, TensorBoard
    ("config.flags", "config.limits", "config.run"),  # what a config section is made of
    ("user",),                   # the user's parts and recipe; the user's script in a worker
    ("data",),
    ("models",),
    ("sync",),                   # the strategies and their registry
    ("step",),                   # the fast step, over a strategy
    ("train.eval_options",),     # the last section
    ("config",),                 # TrainConfig, composed of the sections declared below it
    ("record.runs", "record.weights"),  # the run directory and the weights: read and write a TrainConfig
    ("launch",),                 # processes: pool, forkserver, launcher environment, placement
    ("sweeps.pruning", "sweeps.results"),  # the results file and exact pruning (the loop's watch)
    ("train",),
    ("report",),                 # reads run directories, sweeps' results and winners
    ("sweeps",),                 # the grid, the trials, studies: draw the report when they end
    ("bench",),
    ("analysis",),               # simulate reads bench's timings; advise reads sweeps' results
    ("experiments",),
    ("cli",),
]
"""The layers of shmlearn/, lowest first: a module imports only from its own layer and the layers
below (DESIGN.md, Architecture). An entry names a package (`sync`) or a module of one
(`record.runs`); a module belongs to the longest entry that names it or its package, so a package
whose low modules serve the layers below it (record's files, config's section machinery, sweeps'
winner rule) has its higher modules listed apart. The order is the import graph's (docs/
architecture.md draws it); the top-level modules (shmlearn/__init__.py, __main__.py) sit above
every layer, errors.py is the lowest."""

MAX_TOP_MODULES = 8


def _package(mod: str) -> str:
    """The package of a dotted module name under shmlearn ('shmlearn.sync.ddp' -> 'sync';
    'shmlearn.errors' -> 'errors'; the package itself -> '')."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer_entry(mod: str, entries) -> str:
    """The longest entry of `entries` naming mod or a package above it ('shmlearn.record.runs' ->
    'record.runs'; 'shmlearn.record.timing' -> 'record'), or '' for the top-level modules."""
    parts = mod.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in entries:
            return ".".join(parts[:n])
    return ""


def upward_imports(graph: dict[str, dict[str, list[int]]], layers=None) -> list[str]:
    """'importer -> imported (line N)' for each import of a module in a layer above the importer's."""
    level = {p: i for i, group in enumerate(layers or LAYERS) for p in group}
    bad = []
    for mod, targets in sorted(graph.items()):
        src = _layer_entry(mod, level)
        if not src:  # shmlearn/__init__.py, __main__.py: the public API, above all
            continue
        for t, at in sorted(targets.items()):
            dst = _layer_entry(t, level)
            if level.get(dst, len(level)) > level[src]:
                bad.append(f"{mod} -> {t} (line {', '.join(map(str, at))})")
    return bad


def test_every_package_has_a_layer():
    mods = _modules()
    packages = {_package(m) for m in mods if _package(m)} - {"__main__"}
    listed = {p for group in LAYERS for p in group if "." not in p}
    modules = {p for group in LAYERS for p in group if "." in p}
    unknown = sorted(m for m in modules if f"shmlearn.{m}" not in mods)
    assert not unknown, f"layers naming no module: {unknown}"
    assert packages == listed, (f"packages without a layer: {sorted(packages - listed)}; "
                                f"layers naming no package: {sorted(listed - packages)}")


def test_no_module_imports_a_package_above_its_own():
    bad = upward_imports(import_graph())
    assert not bad, "imports of a package above the importer's layer (LAYERS):\n" + "\n".join(bad)


def test_upward_import_checker():
    graph = {"shmlearn.nn.a": {"shmlearn.errors": [1]},
             "shmlearn.sync.b": {"shmlearn.nn.a": [2], "shmlearn.sync.c": [3]},
             "shmlearn.nn.d": {"shmlearn.sync.b": [4]},
             "shmlearn": {"shmlearn.sync.b": [5]}}
    layers = [("errors",), ("nn",), ("sync",)]
    assert upward_imports(graph, layers) == ["shmlearn.nn.d -> shmlearn.sync.b (line 4)"]
    # a module listed apart takes its own layer: sync.b below nn makes nn.d's import legal, and
    # sync.b's imports of nn.a and of its own package's sync.c (both now above it) illegal
    layers = [("errors",), ("sync.b",), ("nn",), ("sync",)]
    assert upward_imports(graph, layers) == ["shmlearn.sync.b -> shmlearn.nn.a (line 2)",
                                             "shmlearn.sync.b -> shmlearn.sync.c (line 3)"]


def test_every_package_says_what_it_owns():
    """Each package's __init__.py opens with a docstring (the map in docs/architecture.md)."""
    missing = [path.parent.relative_to(ROOT.parent).as_posix() for path in sorted(ROOT.rglob("__init__.py"))
               if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()]
    assert not missing, f"packages without a docstring of what they own: {missing}"


def test_few_modules_at_the_top():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top of shmlearn/ (at most {MAX_TOP_MODULES}): {top}"
