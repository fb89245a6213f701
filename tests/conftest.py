import sys

import pytest

_torch_threads = None
"""torch's intra-op thread count when the session's tests were collected (None: torch not imported)."""


def pytest_collection_finish(session):
    """The session's final selection, for triton_interp.interpreted_together (one interpreter
    process per module runs that module's selected tests); and torch's thread count before any test."""
    global _torch_threads
    import triton_interp
    triton_interp.collection_finished(session.items)
    if "torch" in sys.modules:
        _torch_threads = sys.modules["torch"].get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_put_back():
    """A test (or a module fixture it set up) that trains in this process leaves torch's thread count
    where the rank set it (run_worker sets the rank's own and keeps it): it is put back after each
    test, so the tests after it run as they do alone."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and _torch_threads is not None and torch.get_num_threads() != _torch_threads:
        torch.set_num_threads(_torch_threads)
