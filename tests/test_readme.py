"""The README's commands, run from a clone as written: what they write into the checkout is
ignored by git (ps-sim.json and sim-*/ were not)."""
import os
import re
import shlex
import subprocess

import pytest

from procs import mpirun_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = {("bench", "comm"): "comm.json", ("bench", "ps-sim"): "ps-sim.json",
               ("bench", "throughput"): "throughput.json", ("simulate",): "simulate"}
"""Where a command writes without --out (its argparse default)."""


def written_by_readme_commands():
    """Every path a shmlearn command in the bash blocks of the README and of docs/*.md writes (the
    README's reference sections and performance log moved there), relative to the clone."""
    blocks = []
    docs = sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    for name in ["README.md", *docs]:
        with open(os.path.join(ROOT, name)) as f:
            blocks += re.findall(r"```bash\n(.*?)```", f.read(), re.S)
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


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".git")), reason="needs the git checkout")  # a file in a worktree
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


# --- the own-model script (issue 16) --------------------------------------------------------

EXAMPLE = os.path.join(ROOT, "examples", "own_model.py")


def test_readme_shows_the_own_model_script_as_it_is():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(EXAMPLE) as f:
        script = f.read()
    assert "```python\n" + script + "```" in readme


def _accuracies(out: str) -> dict:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(allreduce|ps): test accuracy ([0-9.]+)", out, re.M)}


LAUNCHERS = ["local", "torchrun", "mpirun"]


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """{launcher: the script's finished process, or None where the launcher is missing}: the three
    launches started together, each in a folder of its own (one after the other they took ~45 s
    here; each spends part of its time in imports and rendezvous while a core is free)."""
    import shutil
    import sys
    from shmlearn.launch.start import free_port
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_", "OMPI_", "PMI", "SLURM"))}
    env["PYTHONUNBUFFERED"] = "1"
    started = {}
    try:
        for launcher in LAUNCHERS:
            run_env = dict(env)
            if launcher == "local":
                cmd = [sys.executable, EXAMPLE]
            elif launcher == "torchrun":
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", EXAMPLE]
            else:
                if shutil.which("mpirun") is None:
                    started[launcher] = None
                    continue
                run_env = mpirun_env(dict(run_env, MASTER_PORT=str(free_port())))
                cmd = ["mpirun", "-np", "2", "--oversubscribe", "-x", "PYTHONUNBUFFERED", "-x", "PATH", "-x",
                       "MASTER_PORT", sys.executable, EXAMPLE]
                if os.geteuid() == 0:
                    cmd[1:1] = ["--allow-run-as-root"]
            started[launcher] = subprocess.Popen(cmd, cwd=tmp_path_factory.mktemp(launcher), env=run_env,
                                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outs = {k: (p.communicate(timeout=600) if p else None) for k, p in started.items()}
    finally:
        for p in started.values():
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    return {k: (subprocess.CompletedProcess(p.args, p.returncode, *outs[k]) if p else None)
            for k, p in started.items()}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_own_model_script_runs_as_written_and_reaches_the_stated_accuracy(launcher, script_runs):
    """README: 'Both print allreduce: test accuracy 0.919 and ps: test accuracy 0.919'."""
    p = script_runs[launcher]
    if p is None:
        pytest.skip("needs Open MPI's mpirun (apt-get install openmpi-bin)")
    assert p.returncode == 0, p.stderr[-2000:]
    acc = _accuracies(p.stdout)
    assert set(acc) == {"allreduce", "ps"}, p.stdout
    for strategy, a in acc.items():  # seeded: the same weights in both launch modes
        assert a >= 0.91, (strategy, a)
    assert p.stdout.count("test accuracy") == 2  # rank 0 alone prints under a launcher
