"""Running a test in Triton's interpreter on the CPU (tests/ is on pytest's pythonpath)."""
import pytest


def interpreted(test):
    """Run the test in Triton's interpreter, which must be chosen before Triton is first imported
    (its own library functions are compiled then): in a fresh pytest process with
    TRITON_INTERPRET=1, unless this is that process."""
    import functools
    import os

    @functools.wraps(test)
    def run(*args, **kwargs):
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") == "1":
            return test(*args, **kwargs)
        import subprocess
        import sys
        node = os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                           env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    return run


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
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]
        here = os.path.abspath(inspect.unwrap(test).__code__.co_filename)  # under tests/inductor.py's wrapper too
        if here not in _outcomes:
            _outcomes[here] = _run_interpreted(_selected.get(here) or [node])
        outcomes = _outcomes[here]
        outcome, report = outcomes.get(node.rsplit("::", 1)[1], ("missing", outcomes[""][1]))
        if outcome == "skipped":
            pytest.skip(f"in Triton's interpreter: {report}")
        assert outcome == "passed", f"{node} in Triton's interpreter: {outcome}\n{report}"
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
                outcomes[case.get("name")] = ((bad[0].tag, (bad[0].get("message") or "") + "\n" + (bad[0].text or ""))
                                              if bad else ("passed", ""))
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
