"""Every relative link in README.md, docs/ and results/ resolves, and the evidence stays small
(issue 54, acceptance 4): a markdown link `[text](path#anchor)` or `<img src="path">` names a file
or folder that exists (an anchor into a .md file names one of its headings), every path under
results/ that README.md or docs/ quote in prose or a command exists, and results/ holds at most 8 MB."""
import glob
import itertools
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_LIMIT = 8 * 2 ** 20
"""bytes on disk under results/ (as `du -s` counts them: 4 KiB blocks, folders included)."""

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img\s[^>]*?src=[\"']([^\"']+)[\"']")
QUOTED = re.compile(r"(?<![\w./-])results/[\w.*?{},/+-]*")


def docs(root: str = ROOT) -> list:
    """The markdown files whose links must resolve: README.md, docs/**/*.md, results/**/*.md."""
    found = [os.path.join(root, "README.md")] if os.path.exists(os.path.join(root, "README.md")) else []
    for sub in ("docs", "results"):
        found += sorted(glob.glob(os.path.join(root, sub, "**", "*.md"), recursive=True))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays, its target goes
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set:
    """The anchors of a markdown file's headings (outside code blocks), duplicates numbered as GitHub does."""
    with open(path, encoding="utf-8") as f:
        text = FENCE.sub("", f.read())
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def _lines(text: str):
    """(line number, line) of the text with fenced code blocks blanked, so numbers stay right."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return enumerate(text.splitlines(), 1)


def dead_links(files: list) -> list:
    """'FILE:LINE: TARGET (why)' for each markdown link or image in FILES that does not resolve."""
    dead = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for n, line in _lines(text):
            for m in LINK.finditer(CODE.sub("", line)):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                    continue
                where, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(os.path.dirname(path), where)) if where else path
                why = None
                if not os.path.exists(full):
                    why = "no such file"
                elif anchor and full.endswith(".md") and anchor.lower() not in anchors(full):
                    why = f"no heading #{anchor} there"
                if why:
                    dead.append(f"{os.path.relpath(path, ROOT)}:{n}: {target} ({why})")
    return dead


def _braces(p: str) -> list:
    m = re.search(r"\{([^{}]*)\}", p)
    if not m:
        return [p]
    return list(itertools.chain.from_iterable(_braces(p[:m.start()] + alt + p[m.end():]) for alt in m.group(1).split(",")))


def dead_quotes(files: list, root: str = ROOT) -> list:
    """'FILE:LINE: PATH' for each results/... path quoted in FILES (prose or commands; braces and
    globs allowed) that names nothing in the checkout."""
    dead = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for n, line in enumerate(text.splitlines(), 1):
            for m in QUOTED.finditer(line):
                quoted = m.group(0).rstrip(".,")
                if not all(glob.glob(os.path.join(root, p)) for p in _braces(quoted)):
                    dead.append(f"{os.path.relpath(path, ROOT)}:{n}: {quoted}")
    return dead


def disk_bytes(folder: str) -> int:
    """What `du -s` counts for FOLDER on a 4 KiB-block file system: each file rounded up, and folders."""
    total = 0
    for here, dirs, names in os.walk(folder):
        total += 4096
        total += sum(-(-os.path.getsize(os.path.join(here, n)) // 4096) * 4096 for n in names)
    return total


def test_every_relative_link_resolves():
    files = docs()
    assert len(files) > 20, files  # README, the docs and the results' own pages were found
    dead = dead_links(files)
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_every_quoted_results_path_exists():
    files = [f for f in docs() if not os.path.relpath(f, ROOT).startswith("results" + os.sep)]
    dead = dead_quotes(files)
    assert not dead, "quoted paths under results/ that do not exist:\n" + "\n".join(dead)


def test_results_hold_at_most_8_mb():
    size = disk_bytes(os.path.join(ROOT, "results"))
    assert 0 < size <= RESULTS_LIMIT, f"results/ holds {size / 2 ** 20:.1f} MiB (limit 8)"


def test_the_index_names_every_entry_of_results():
    """results/README.md has a row for each file and folder at the top of results/."""
    with open(os.path.join(ROOT, "results", "README.md"), encoding="utf-8") as f:
        index = f.read()
    missing = [n for n in sorted(os.listdir(os.path.join(ROOT, "results")))
               if n != "README.md" and f"]({n}" not in index]
    assert not missing, f"not in results/README.md: {missing}"


# --- the checks themselves fail on what they exist to catch ---------------------------------

@pytest.fixture
def tree(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "results" / "run").mkdir(parents=True)
    (tmp_path / "results" / "run" / "a.json").write_text("{}")
    (tmp_path / "results" / "run" / "NOTES.md").write_text("# Notes\n\n## Reruns on a busy machine (issue 55)\n")
    return tmp_path


def test_a_dead_link_is_reported(tree):
    doc = tree / "docs" / "page.md"
    doc.write_text("# Page\n\nSee [the run](../results/run/a.json) and [gone](../results/run/b.json).\n"
                   "![figure](../results/run/fig.png)\n<img src=\"../results/run/a.json\">\n"
                   "[notes](../results/run/NOTES.md#reruns-on-a-busy-machine-issue-55) "
                   "[bad anchor](../results/run/NOTES.md#no-such-heading) [web](https://example.com/x)\n"
                   "`[in code](nothing.md)`\n```\n[in a block](nothing.md)\n```\n[self](#page) [self bad](#nope)\n")
    dead = dead_links([str(doc)])
    assert [d.split(": ", 1)[1] for d in dead] == [
        "../results/run/b.json (no such file)", "../results/run/fig.png (no such file)",
        "../results/run/NOTES.md#no-such-heading (no heading #no-such-heading there)",
        "#nope (no heading #nope there)"], dead
    assert all(d.startswith(os.path.relpath(str(doc), ROOT)) for d in dead)


def test_a_quoted_path_that_is_gone_is_reported(tree):
    doc = tree / "docs" / "page.md"
    doc.write_text("Numbers in `results/run/a.json`, `results/run/{a,b}.json` and results/run/*.json;\n"
                   "the old `results/run/report.html` is gone, and so is results/other/.\n")
    dead = dead_quotes([str(doc)], root=str(tree))
    assert [d.split(": ", 1)[1] for d in dead] == ["results/run/{a,b}.json", "results/run/report.html",
                                                    "results/other/"], dead


def test_disk_bytes_counts_blocks_and_folders(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "one").write_bytes(b"x")
    (tmp_path / "d" / "big").write_bytes(b"x" * 4097)
    assert disk_bytes(str(tmp_path)) == 4096 * 2 + 4096 + 2 * 4096
