"""Running a test in Triton's interpreter on the CPU (tests/ is on pytest's pythonpath)."""
import pytest


def interpreted(test):
    """Run the test in Triton's interpreter, which must be chosen before Triton is first imported
    (its own library functions are compiled then): in a fresh pytest process with
    TRITON_INTERPRET=1, unless this is that process. Where that Triton's interpreter has the index
    bug (`interpreter_bug`), the test skips, saying so."""
    import functools
    import os

    @functools.wraps(test)
    def run(*args, **kwargs):
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") == "1":
            _skip_where_interpreter_is_broken()
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]
        _report(node, _run_interpreted([node]))
    return run


def _report(node, outcomes):
    """Pass, fail or skip as the interpreter process's report of `node` says."""
    outcome, report = outcomes.get(node.rsplit("::", 1)[1], ("missing", outcomes[""][1]))
    if outcome == "skipped":
        pytest.skip(f"in Triton's interpreter: {report}")
    assert outcome == "passed", f"{node} in Triton's interpreter: {outcome}\n{report}"


# --- an interpreter that cannot run our kernels ----------------------------------------------------
# Some Triton releases' interpreters (seen: the Triton that torch 2.11 bundles, under NumPy 2.x) hold
# a kernel's scalar arguments as 1-element 1-D arrays and take a runtime integer as an index
# (`range(0, K, BLOCK_K)`) with `int(self.handle.data)`, which NumPy 2 refuses ("only 0-dimensional
# arrays can be converted to Python scalars"); newer ones squeeze it first. Every fused kernel loops
# to a runtime bound, so none runs there: the interpreted tests skip, naming the versions, instead of
# failing. The decision comes from running a tiny kernel with such a loop (once per process), and
# only exactly this error skips: any other failure, of the probe or a test, still fails the test.
_INDEX_BUG = "only 0-dimensional arrays can be converted to Python scalars"
_probed = []
"""[interpreter_bug()'s answer] once this process ran the probe."""


def index_bug_reason(error: str, triton_version: str, numpy_version: str):
    """The skip reason when `error` (type name and message of what the probe kernel raised, with
    its cause's) is that interpreter bug; else None."""
    if "InterpreterError" in error and "TypeError" in error and _INDEX_BUG in error:
        return (f"Triton {triton_version}'s interpreter cannot use a runtime integer as an index under "
                f"NumPy {numpy_version} (int() of a 1-element array: {_INDEX_BUG!r}); a newer Triton fixes "
                f"it: pip install -U triton")
    return None


def _error_text(e: BaseException) -> str:
    """`e`'s type name and message, then its causes', one a line."""
    lines = []
    while e is not None and len(lines) < 8:
        lines.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(lines)


def _probe_kernel():
    """Runs, in Triton's interpreter, a kernel that loops to a runtime integer bound; returns what it
    stored (5 rounded up to blocks of 2: 3 in each of 2 lanes)."""
    global tl  # the kernel's globals: the interpreter re-executes its source in its module's globals
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _loop_to_a_runtime_bound(out_ptr, n, BLOCK: tl.constexpr):
        acc = tl.arange(0, BLOCK) * 0  # not tl.zeros, a jit library function (tests/test_triton_interp.py)
        for _ in range(0, n, BLOCK):
            acc += 1
        tl.store(out_ptr + tl.arange(0, BLOCK), acc)

    out = torch.zeros(2, dtype=torch.int32)
    _loop_to_a_runtime_bound[(1,)](out, 5, BLOCK=2)
    return out.tolist()


def probe():
    """In a TRITON_INTERPRET=1 process: the skip reason where this Triton's interpreter has the index
    bug (index_bug_reason), found by running the probe kernel; else None (any other error of the
    probe is left to the tests, which then fail on their own)."""
    import numpy
    import triton
    try:
        _probe_kernel()
    except Exception as e:  # noqa: BLE001 - only the one known error is recognised
        return index_bug_reason(_error_text(e), triton.__version__, numpy.__version__)
    return None


def interpreter_bug():
    """probe()'s answer, probed once per process."""
    if not _probed:
        _probed.append(probe())
    return _probed[0]


def _skip_where_interpreter_is_broken():
    reason = interpreter_bug()
    if reason:
        pytest.skip(reason)


# --- several interpreted tests of a module in ONE fresh process ------------------------------------
# `interpreted` starts a pytest process per test: ~3 s of imports apiece on a 2-core machine, more
# than most of these tests compute. A test marked `interpreted_together` instead gets its outcome
# from one process that runs all such tests of its module in the session's selection, started by
# the first of them; each test still passes or fails on its own outcome there, with that process's
# report of it. The tests then share that process: one that changes module settings puts them back
# (tests/nn/test_conv_pool.py's _fresh_kernel_settings).
_TOGETHER = "_interpreted_together"
_selected = {}
"""{module file: node ids of its interpreted_together tests in the session's selection, in order}"""
_outcomes = {}
"""{module file: {test name: (passed|failed|error|skipped, report)}} once its process ran"""


def collection_finished(items):
    """Called by tests/conftest.py once the session's selection is final."""
    import os
    _selected.clear()
    _outcomes.clear()
    for item in items:
        if getattr(getattr(item, "obj", None), _TOGETHER, False):
            _selected.setdefault(os.path.abspath(str(item.fspath)), []).append(item.nodeid)


def interpreted_together(test):
    """As `interpreted`, in one process with its module's other such tests."""
    import functools
    import inspect
    import os

    @functools.wraps(test)
    def run(*args, **kwargs):
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") == "1":
            _skip_where_interpreter_is_broken()
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]
        here = os.path.abspath(inspect.unwrap(test).__code__.co_filename)  # under tests/inductor.py's wrapper too
        if here not in _outcomes:
            _outcomes[here] = _run_interpreted(_selected.get(here) or [node])
        _report(node, _outcomes[here])
    setattr(run, _TOGETHER, True)
    return run


def _run_interpreted(nodes):
    """{test name: (passed|failed|error|skipped, report)} of one pytest process with TRITON_INTERPRET=1
    over `nodes`; under "": that process's output tail (its report when it left none per test)."""
    import os
    import subprocess
    import sys
    import tempfile
    import xml.etree.ElementTree as ET
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        xml = os.path.join(d, "interpreted.xml")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                            *nodes], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                           cwd=root)
        tail = f"exit {r.returncode}\n" + r.stdout[-3000:] + r.stderr[-2000:]
        outcomes = {"": ("", tail)}
        if os.path.exists(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                bad = [e for e in case if e.tag in ("failure", "error", "skipped")]
                outcomes[case.get("name")] = (
                    ("passed", "") if not bad else
                    ("skipped", bad[0].get("message") or bad[0].text or "") if bad[0].tag == "skipped" else
                    (bad[0].tag, (bad[0].get("message") or "") + "\n" + (bad[0].text or "")))
    return outcomes


# --- a run small enough for the interpreter --------------------------------------------------------
def small_digits(test):
    """digits as a user's own arrays (train()'s data=), standardized, with only the first `test`
    test samples: in the interpreter a kernel call over a batch costs seconds on two cores, and
    evaluating digits' 360 test samples before and after training was most of a short run's time.
    Training samples from the whole training set."""
    from shmlearn.data import load_dataset
    d = load_dataset("digits")
    mean, std = d.train_x.float().mean(), d.train_x.float().std()
    return (((d.train_x.float() - mean) / std).numpy(), d.train_y.numpy(),
            ((d.test_x[:test].float() - mean) / std).numpy(), d.test_y[:test].numpy())
