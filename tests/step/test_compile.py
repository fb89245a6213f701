"""shmlearn/step/compile.py: a step whose code Inductor cannot build runs eagerly, on any CPU.

Inductor's C++ build is made to fail (as it does under ATEN_CPU_CAPABILITY=default for some
kernels, tests/inductor.py): the run completes eagerly, says why, and is the eager run bit for
bit; an error that is not a build failure is still raised."""
import contextlib
import json
import os
import shlex

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import WorkerFailed
from shmlearn.launch.start import DistEnv, free_port
from shmlearn.step.compile import build_failure
from procs import processes

NOTE = ("--compile default: Inductor could not build the step's code on this machine "
        "(CppCompileError: C++ compile error); the step runs eagerly")


@contextlib.contextmanager
def _builds_fail(error=None):
    """Every C++ build Inductor starts raises error (default: a CppCompileError, as a compiler's
    failure gives): in this process (compile_threads 1: no compile workers, which the patch would
    not reach), with empty caches (a cached build would not be built again); all put back after."""
    from torch._inductor import config, cpp_builder, exc
    from torch._inductor.utils import fresh_cache

    def run_compile_cmd(cmd_line, cwd):
        raise error or exc.CppCompileError(shlex.split(cmd_line), "forced")
    real = cpp_builder._run_compile_cmd
    torch._dynamo.reset()
    try:
        with fresh_cache(), config.patch(compile_threads=1):
            cpp_builder._run_compile_cmd = run_compile_cmd
            yield
    finally:
        cpp_builder._run_compile_cmd = real
        torch._dynamo.reset()  # no graph of this test's compiles is reused by the next test


def _cfg(out, compile, workers=1):
    return TrainConfig(workers=workers, device="cpu", samples=32 * 8, compile=compile, log_every=1, eval_points=1,
                       progress=False, out=str(out))


def _losses(out):
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def test_build_failure_finds_the_compilers_error_in_the_chain_and_nothing_else():
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError
    built = CppCompileError(["c++", "k.cpp"], "error: 'at::vec' has not been declared")
    try:
        try:
            raise built
        except CppCompileError as e:
            raise RuntimeError("while compiling") from e
    except RuntimeError as e:
        caused = e
    wrapped = BackendCompilerFailed(lambda *a: None, caused, None)  # Dynamo's: the error as inner_exception
    assert build_failure(built) is built and build_failure(caused) is built and build_failure(wrapped) is built
    assert build_failure(RuntimeError("not a build")) is None
    assert build_failure(BackendCompilerFailed(lambda *a: None, RuntimeError("no"), None)) is None


def test_a_step_that_does_not_build_runs_eagerly_says_why_and_is_the_eager_run(tmp_path):
    eager = shmlearn.train(_cfg(tmp_path / "off", "off"))
    with _builds_fail():
        unbuilt = shmlearn.train(_cfg(tmp_path / "default", "default"))
    s = unbuilt.summary
    assert s["status"] == "completed" and s["compile"] == "off" and s["compile_s"] is None
    assert s["compile_read"] is False and s["step_note"] == NOTE
    assert eager.summary["compile"] == "off" and eager.summary["step_note"] is None
    assert len(_losses(tmp_path / "off")) == 8 and _losses(tmp_path / "default") == _losses(tmp_path / "off")
    assert s["final_loss"] == eager.summary["final_loss"]
    for a, b in zip(unbuilt.model.parameters(), eager.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_error_that_is_not_a_build_failure_is_raised(tmp_path):
    with _builds_fail(RuntimeError("not a build failure")), pytest.raises(
            WorkerFailed, match=r"^rank 0: InductorError: RuntimeError: not a build failure"):
        shmlearn.train(_cfg(tmp_path / "run", "default"))


def _worker(rank, world, port, out):
    """An eager run, then a --compile default run in which rank 1's build fails and rank 0's
    compile succeeds (torch.compile gives the function back, as a build would, at no cost): both
    ranks must run eagerly, or they would run different steps. Rank 0 saves both runs' summaries
    and weights."""
    from shmlearn.train.entry import run_worker
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, launcher="local",
                  master_port=port)
    results = {"off": run_worker(_cfg(os.path.join(out, "off"), "off", world), env)}
    if rank == 0:
        real, torch.compile = torch.compile, (lambda fn, *a, **k: fn)
    with _builds_fail() if rank == 1 else contextlib.nullcontext():
        results["default"] = run_worker(_cfg(os.path.join(out, "default"), "default", world), env)
    if rank == 0:
        torch.compile = real
        torch.save({c: (r.summary, r.model.state_dict()) for c, r in results.items()},
                   os.path.join(out, "rank0.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as tests/train/test_noise.py: skip the interpreter-exit teardown


def test_every_rank_runs_eagerly_when_one_ranks_step_does_not_build(tmp_path):
    processes(_worker, (2, free_port(), str(tmp_path)), 2)
    runs = torch.load(tmp_path / "rank0.pt", weights_only=False)  # summaries too; this test wrote it
    (eager, eager_w), (s, w) = runs["off"], runs["default"]
    assert s["status"] == "completed" and s["compile"] == "off" and s["compile_s"] is None
    assert s["step_note"] == ("--compile default: Inductor could not build the step's code on this machine "
                              "(on 1 other rank(s)); the step runs eagerly")
    assert _losses(tmp_path / "default") == _losses(tmp_path / "off") and s["final_loss"] == eager["final_loss"]
    assert w.keys() == eager_w.keys() and all(torch.equal(w[k], eager_w[k]) for k in w)
