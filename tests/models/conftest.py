import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run tiny batches, where a second intra-op thread saves nothing and, on a
    shared 2-core box, OpenMP spin-waiting against other processes made them ~5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
