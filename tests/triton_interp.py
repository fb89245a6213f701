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
