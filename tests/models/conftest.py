import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """These tests run tiny batches (tests/conftest.py one_thread)."""
    yield
