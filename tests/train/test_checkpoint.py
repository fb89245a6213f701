"""Checkpoint files: atomic, checksummed; damage of every kind is detected (issue 6)."""
import os

import pytest
import torch

from shmlearn.train import checkpoint as ckpt


def test_roundtrip_and_damage(tmp_path):
    p = str(tmp_path / "rank0.ckpt")
    state = {"w": torch.randn(1000), "step": 7}
    ckpt.write_file(p, state)
    back = ckpt.read_file(p)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 7
    assert os.listdir(tmp_path) == ["rank0.ckpt"]  # no temporary file left beside it
    raw = open(p, "rb").read()

    open(p, "wb").write(raw[:-10])
    with pytest.raises(ckpt.CorruptCheckpoint, match="truncated"):
        ckpt.read_file(p)
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01
    open(p, "wb").write(bytes(flipped))
    with pytest.raises(ckpt.CorruptCheckpoint, match="checksum"):
        ckpt.read_file(p)
    open(p, "wb").write(b"PK" + raw[2:])
    with pytest.raises(ckpt.CorruptCheckpoint, match="magic"):
        ckpt.read_file(p)
    open(p, "wb").write(raw[:5])
    with pytest.raises(ckpt.CorruptCheckpoint, match="truncated"):
        ckpt.read_file(p)
    os.remove(p)
    with pytest.raises(ckpt.CorruptCheckpoint, match="missing"):
        ckpt.read_file(p)


def test_only_complete_checkpoints_are_candidates_and_prune_keeps_two(tmp_path):
    run = str(tmp_path)
    for step in (10, 20, 30):
        os.makedirs(ckpt.step_dir(run, step))
        ckpt.write_file(os.path.join(ckpt.step_dir(run, step), "rank0.ckpt"), {"step": step})
        ckpt.mark_complete(run, step, 1)
    os.makedirs(ckpt.step_dir(run, 40))  # started, never completed
    assert ckpt.candidates(run) == [30, 20, 10]
    ckpt.prune(run)
    assert ckpt.candidates(run) == [30, 20]
    assert os.path.isdir(ckpt.step_dir(run, 40)) and not os.path.isdir(ckpt.step_dir(run, 10))
