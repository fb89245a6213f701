"""The README's commands, run from a clone as written: what they write into the checkout is
ignored by git (ps-sim.json and sim-*/ were not)."""
import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = {("bench", "comm"): "comm.json", ("bench", "ps-sim"): "ps-sim.json",
               ("bench", "throughput"): "throughput.json", ("simulate",): "simulate"}
"""Where a command writes without --out (its argparse default)."""


def written_by_readme_commands():
    """Every path a shmlearn command in the README's bash blocks writes, relative to the clone."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    paths = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if "shmlearn" not in words:
            continue
        args = words[words.index("shmlearn") + 1:]
        command = next((k for k in DEFAULT_OUT if tuple(args[:len(k)]) == k), None)
        out = args[args.index("--out") + 1] if "--out" in args else DEFAULT_OUT.get(command)
        if out is None or out.isupper():  # no file, or a placeholder (OUT) the user names
            continue
        if command == ("simulate",):  # a directory
            paths.append(f"{out}/simulate.json")
        elif command in (("bench", "comm"), ("bench", "ps-sim")):  # the JSON and its plot
            paths += [out, os.path.splitext(out)[0] + ".png"]
        else:
            paths.append(out)
    return paths


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="needs the git checkout")
def test_what_the_readme_commands_write_is_ignored():
    paths = written_by_readme_commands()
    assert {"ps-sim.json", "sim-resnet34-nvlink/simulate.json", "comm.json"} <= set(paths), paths
    paths += ["experiments/20261124-120000-cnn/table.md"]  # `shmlearn experiment run NAME`'s default
    missed = [p for p in paths
              if subprocess.run(["git", "check-ignore", "-q", "--no-index", p], cwd=ROOT).returncode != 0]
    assert not missed, f"not in .gitignore: {missed}"
    # the patterns are anchored at the root: source folders of the same names stay tracked
    for source in ("shmlearn/experiments/__init__.py", "tests/experiments/test_experiments.py"):
        assert subprocess.run(["git", "check-ignore", "-q", "--no-index", source], cwd=ROOT).returncode == 1
