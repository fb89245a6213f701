"""The launcher environment (launch/env.py): every variable checked for type, range and consistency
before any socket opens, one line per problem naming the variable, its value and what is expected,
exit 2; each rendezvous bounded by --timeout (launch.py, listen.py)."""
import os
import socket
import subprocess
import sys

import pytest

from shmlearn.errors import BadInput
from shmlearn.launch.start import free_port
from shmlearn.launch.start import detect_env
from shmlearn.launch.start import detect_env as parse  # the one parser (launch_env.parse)

ARGS = ["train", "--samples", "2000", "--eval-points", "1", "--no-progress"]


def refused(env: dict) -> str:
    with pytest.raises(BadInput) as e:
        parse(env)
    return str(e.value)


@pytest.mark.parametrize("env, names", [
    ({"RANK": "0", "WORLD_SIZE": "two"}, ["WORLD_SIZE='two'", "whole number >= 1"]),
    ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'", "whole number >= 0"]),
    ({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_RANK='0'", "OMPI_COMM_WORLD_SIZE is not"]),
    ({"PMI_SIZE": "2"}, ["PMI_SIZE='2'", "PMI_RANK is not"]),
    ({"RANK": "0"}, ["RANK='0'", "WORLD_SIZE is not"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "x"}, ["SLURM_NTASKS='x'", "whole number >= 1"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "x"}, ["SLURM_STEP_NUM_TASKS='x'"]),
    ({"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "2"}, ["SLURM_PROCID='4'", "below SLURM_STEP_NUM_TASKS=2"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, ["MASTER_PORT='70000'", "from 1 to 65535"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"}, ["MASTER_PORT='http'"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": " "}, ["MASTER_ADDR=' '", "host name"]),
    ({"RANK": "3", "WORLD_SIZE": "2"}, ["RANK='3'", "below WORLD_SIZE=2", "0 to 1"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE='0'", "whole number >= 1"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK='2'"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, ["LOCAL_WORLD_SIZE='4'", "at most WORLD_SIZE=2"]),
    ({"OMPI_COMM_WORLD_RANK": "-1", "OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_RANK='-1'"]),
])
def test_each_problem_is_one_line_naming_the_variable_its_value_and_what_is_expected(env, names):
    text = refused(env)
    for n in names:
        assert n in text, text
    assert "expected" in text or "is not" in text


def test_every_problem_is_reported_at_once_in_one_line():
    text = refused({"RANK": "x", "WORLD_SIZE": "y", "MASTER_PORT": "0"})
    assert len(text.splitlines()) == 1, text
    problems = text.split(": ", 1)[1].split("; ")
    assert len(problems) == 3, text
    assert [p.split("=")[0] for p in problems] == ["WORLD_SIZE", "RANK", "MASTER_PORT"], text


def test_a_variable_read_twice_is_one_problem_and_the_refusal_one_line():
    # srun's SLURM_NTASKS and SLURM_STEP_NUM_TASKS both wrong: SLURM_STEP_NUM_TASKS is read as a
    # count and as the world size, and was named twice, over three lines (the campaign's
    # env-slurm-ntasks-x)
    text = refused({"SLURM_PROCID": "0", "SLURM_NTASKS": "x", "SLURM_STEP_NUM_TASKS": "x"})
    assert len(text.splitlines()) == 1, text
    assert text.count("SLURM_STEP_NUM_TASKS='x'") == 1 and text.count("SLURM_NTASKS='x'") == 1, text


def test_valid_environments_are_read_as_before():
    e = parse({"RANK": " 1 ", "WORLD_SIZE": "2", "MASTER_PORT": "1234", "MASTER_ADDR": "h"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_port, e.master_addr) == (1, 2, 0, 2, 1234, "h")
    assert parse({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": ""}).master_port == 29500
    # an sbatch script (no srun step) is no rank, and its Slurm numbers are valid
    assert parse({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}) is None
    assert detect_env({}) is None


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC", "SHMLEARN_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def program(tmp_path, env: dict, *flags, timeout=240):
    return subprocess.run([sys.executable, "-m", "shmlearn", *ARGS, *flags, "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=timeout, env=_env(**env))


def one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("env, code, words", [
    ({"RANK": "0", "WORLD_SIZE": "two"}, 2, ["WORLD_SIZE='two'"]),
    ({"OMPI_COMM_WORLD_RANK": "0"}, 2, ["OMPI_COMM_WORLD_SIZE is not"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "x"}, 2, ["SLURM_NTASKS='x'"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, 2, ["MASTER_PORT='70000'"]),
    ({"RANK": "3", "WORLD_SIZE": "2"}, 2, ["RANK='3'"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, 2, ["WORLD_SIZE='0'"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "no-such-host.invalid"}, 2, ["MASTER_ADDR='no-such-host.invalid'"]),
])
def test_the_program_refuses_a_bad_environment_in_one_line(tmp_path, env, code, words):
    r = program(tmp_path, env, "--timeout", "20", timeout=120)
    line = one_line(r)
    assert r.returncode == code, r.stderr
    for w in words:
        assert w in line
    assert "--strategy" not in line  # WORLD_SIZE=0 was a strategy's error
    assert not (tmp_path / "run" / "summary.json").exists()


def test_master_port_already_taken_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = program(tmp_path, {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(port)}, "--timeout", "20")
    line = one_line(r)
    assert r.returncode == 2 and f"MASTER_PORT={port}" in line and "already in use" in line


def test_rank_0_alone_names_the_missing_ranks_after_the_timeout(tmp_path):
    r = program(tmp_path, {"RANK": "0", "WORLD_SIZE": "3", "MASTER_PORT": str(free_port())}, "--timeout", "5")
    line = one_line(r)
    assert r.returncode == 1 and "ranks 1, 2" in line and "--timeout" in line, line
