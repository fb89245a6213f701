"""train.py's process-wide settings."""
import torch

from shmlearn.train import _set_determinism


def test_set_determinism_sets_and_clears_torch_flags():
    cpu = torch.device("cpu")
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    try:
        _set_determinism(True, cpu)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic
        _set_determinism(True, cpu)  # again: unchanged
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        _set_determinism(False, cpu)  # a pool worker's next config clears them
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.deterministic
        torch.use_deterministic_algorithms(True)  # set elsewhere without warn_only: made warn_only
        _set_determinism(True, cpu)
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.backends.cudnn.deterministic = before[1]
