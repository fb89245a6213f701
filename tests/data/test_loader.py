"""The sharded loader: disjoint shards, what they cover, and the single-process equivalence."""
import torch

from shmlearn.data.loader import ShardedLoader
import pytest
from shmlearn.errors import BadInput


def _loaders(n, world, batch, seed=3):
    x = torch.arange(n)
    return [ShardedLoader(x, x, batch_size=batch, shard=r, num_shards=world, seed=seed,
                          normalize=lambda t: t) for r in range(world)]


@pytest.mark.parametrize("n,world,batch", [(103, 3, 8), (100, 4, 7), (17, 2, 8), (1437, 4, 128)])
def test_shards_are_disjoint_and_cover_whole_global_batches(n, world, batch):
    loaders = _loaders(n, world, batch)
    spe = n // (world * batch)
    for epoch in range(3):
        seen = [torch.cat([ld.batch(epoch * spe + i)[0] for i in range(spe)]) for ld in loaders]
        allx = torch.cat(seen)
        # disjoint within an epoch, and exactly spe*world*batch samples (the remainder is skipped)
        assert len(allx) == len(set(allx.tolist())) == spe * world * batch
        for s in seen:
            assert len(s) == spe * batch
    # the union of a step's shard batches is what one process with batch world*B reads
    single = _loaders(n, 1, world * batch)[0]
    for step in range(2 * spe + 1):
        assert torch.equal(torch.cat([ld.batch(step)[0] for ld in loaders]), single.batch(step)[0])


def test_epochs_reshuffle_and_same_seed_same_order():
    a, b = _loaders(64, 2, 8)[0], _loaders(64, 2, 8)[0]
    assert torch.equal(a.batch(0)[0], b.batch(0)[0])
    assert not torch.equal(a.batch(0)[0], a.batch(a.steps_per_epoch)[0])


def test_batch_larger_than_shard_is_bad_input():
    with pytest.raises(BadInput, match="--batch-size 60"):
        _loaders(100, 2, 60)
