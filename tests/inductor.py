"""Tests of compiled code where Inductor cannot build it (tests/ is on pytest's pythonpath).

Under ATEN_CPU_CAPABILITY=default (ATen with no vector ISA) torch 2.13's Inductor writes C++ for
some kernels (int64 masked loads, Welford reductions) that does not build ('at::vec' has not been
declared), while a simple function still builds: no cheap probe predicts it. A test of compiled
code then skips, saying so, instead of failing; where the code builds it asserts everything.
What the library does then (the step runs eagerly) is tested on any CPU by
tests/step/test_compile.py, which makes the build fail."""
import contextlib
import functools

import pytest

UNBUILT = "Inductor could not build the step's code"
"""What a run's note says when its step fell back to eager (shmlearn/step/compile.py)."""


def capability() -> str:
    """The vector ISA ATen's CPU kernels run (default, avx2, avx512, ...)."""
    import torch
    return torch.backends.cpu.get_cpu_capability().lower()


def skip_unbuilt(why: str) -> None:
    pytest.skip(f"Inductor cannot build C++ on this CPU (ATEN_CPU_CAPABILITY={capability()}): {why}")


@contextlib.contextmanager
def builds():
    """Around direct torch.compile calls: a failure to build the compiled code skips the test;
    any other error is raised."""
    from shmlearn.errors import one_line
    from shmlearn.step.compile import build_failure
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only a build failure skips
        built = build_failure(e)
        if built is None:
            raise
        skip_unbuilt(one_line(built))


def needs_build(test):
    """A test of direct torch.compile calls, run inside `builds()`."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        with builds():
            return test(*args, **kwargs)
    return run


def ran_eagerly(note) -> bool:
    """Whether a run's (or a Stepper's) note says its compiled step could not be built."""
    return UNBUILT in (note or "")


def skip_if_ran_eagerly(note) -> None:
    """For a library run with --compile: skip where its step fell back to eager for want of a build."""
    if ran_eagerly(note):
        skip_unbuilt(note)
