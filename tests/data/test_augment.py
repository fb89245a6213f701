"""Device augmentation by index (data/augment.py) and the loader's device-counter path."""
import pytest
import torch

from shmlearn.data.augment import Augment
from shmlearn.data.loader import ShardedLoader
from shmlearn.errors import BadInput


def _images(n=40, c=3, h=6, w=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n, c, h, w), dtype=torch.uint8, generator=g)  # never 0: fill shows


def _reference(x, idx, entries, p):
    """Straight from the definition: out[i, j] = x[i - dy, j' - dx], zero outside, j' mirrored."""
    n, c, h, w = x.shape
    out = torch.zeros(len(idx), c, h, w, dtype=x.dtype)
    for b, (k, e) in enumerate(zip(idx.tolist(), entries.tolist())):
        flip, oy, ox = e & 1, (e >> 8) & 0xFF, (e >> 16) & 0xFF
        for i in range(h):
            for j in range(w):
                jj = w - 1 - j if flip else j
                si, sj = i + oy - p, jj + ox - p
                if 0 <= si < h and 0 <= sj < w:
                    out[b, :, i, j] = x[k, :, si, sj]
    return out


@pytest.mark.parametrize("aug", [Augment(flip=True, translate=2), Augment(translate=1), Augment(flip=True)])
def test_gather_matches_the_definition(aug):
    x = _images()
    table = aug.epoch_table(seed=7, epoch=3, n=len(x), device="cpu")
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))[:16]
    out = aug.gather(aug.pad(x), idx, table[:16], x.shape[2], x.shape[3])
    assert out.shape == (16, 3, 6, 5) and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, _reference(x, idx, table[:16], aug.translate))


def test_table_is_a_function_of_seed_and_epoch_and_covers_every_choice():
    aug = Augment(flip=True, translate=2)
    t = aug.epoch_table(0, 0, 4000, "cpu")
    assert torch.equal(t, aug.epoch_table(0, 0, 4000, "cpu"))
    assert not torch.equal(t, aug.epoch_table(0, 1, 4000, "cpu"))
    assert not torch.equal(t, aug.epoch_table(1, 0, 4000, "cpu"))
    flips = (t & 1).float().mean().item()
    assert 0.45 < flips < 0.55
    for shift in (8, 16):
        counts = torch.bincount((t >> shift) & 0xFF, minlength=5)
        assert len(counts) == 5 and counts.min() > 650  # 5 offsets, each ~800 of 4000


@pytest.mark.parametrize("spec,want", [("none", Augment()), ("flip", Augment(flip=True)),
                                       ("translate:2", Augment(translate=2)),
                                       ("flip,translate:3", Augment(flip=True, translate=3)),
                                       ("crop:2,flip", Augment(flip=True, translate=2))])
def test_parse(spec, want):
    assert Augment.parse(spec) == want
    assert Augment.parse(str(want)) == want


@pytest.mark.parametrize("spec", ["rotate", "translate:0", "translate:x", "flip:1"])
def test_bad_spec_is_bad_input(spec):
    with pytest.raises(BadInput, match=f"--augment {spec}"):
        Augment.parse(spec)


def _loaders(x, world, batch, **kw):
    y = torch.arange(len(x))
    return [ShardedLoader(x, y, batch_size=batch, shard=r, num_shards=world, seed=5,
                          normalize=lambda t: t.float(), **kw) for r in range(world)]


@pytest.mark.parametrize("kw", [{}, {"channels_last": True}, {"augment": Augment(flip=True, translate=2)},
                                {"augment": Augment(flip=True, translate=1), "channels_last": True}])
def test_device_counter_reads_the_same_batches_as_batch(kw):
    x = _images(n=37)
    for ld in _loaders(x, 2, 4, **kw):
        spe = ld.steps_per_epoch
        order = list(range(0, 2 * spe + 3)) + [spe + 1, spe + 2, 0, 1]  # epochs, then jumps (resume)
        for step in order:
            ld.prepare(step)
            xa, ya = ld.next_batch()
            xb, yb = ld.batch(step)
            assert torch.equal(xa, xb) and torch.equal(ya, yb), step


def test_shards_of_an_augmented_step_are_the_single_process_batch():
    x = _images(n=50)
    aug = Augment(flip=True, translate=2)
    shards = _loaders(x, 3, 4, augment=aug)
    single = _loaders(x, 1, 12, augment=aug)[0]
    for step in range(9):
        assert torch.equal(torch.cat([ld.batch(step)[0] for ld in shards]), single.batch(step)[0])
