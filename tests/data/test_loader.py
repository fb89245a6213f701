"""The sharded loader: disjoint shards, what they cover, and the single-process equivalence."""
import torch

from shmlearn.data.loader import ShardedLoader
import pytest
from shmlearn.errors import BadInput
from inductor import needs_build


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("augment,channels_last", [(None, False), (None, True), ("flip,translate:2", True)])
@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_compiled_next_batch_reads_the_eager_batches(augment, channels_last, device):
    """The fast step compiles the read (StepTuning.compile_read): torch.compile of next_batch
    (Inductor's C++ kernels on the CPU, Triton's on a GPU) gives the host-indexed batches of
    `batch`, bit for bit, and advances the device counter as the eager read does, across epoch
    boundaries and a jump; also for a second loader of other data and normalization in the same
    process (as a pool worker's next trial has), whose read may reuse the first one's compiled code."""
    from shmlearn.data.augment import Augment

    def loader(seed, m, s):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 256, (50, 3, 6, 5), dtype=torch.uint8, generator=g).to(device)
        y = torch.randint(0, 10, (50,), generator=g).to(device)
        mean = torch.tensor(m, device=device).view(1, 3, 1, 1)
        inv = torch.tensor(s, device=device).view(1, 3, 1, 1)
        return ShardedLoader(x, y, batch_size=7, shard=1, num_shards=2, seed=seed,
                             normalize=lambda t: (t.float() - mean) * inv,
                             augment=Augment.parse(augment), channels_last=channels_last)
    loaders = [loader(5, [10.0, 128.0, 200.0], [0.5, 1 / 64, 0.1]), loader(6, [1.0, 2.0, 3.0], [2.0, 0.25, 1.0])]
    reads = [torch.compile(ld.next_batch, dynamic=False) for ld in loaders]
    for step in [*range(8), 11, 12]:  # 3 steps an epoch; 8 -> 11 is a jump
        for ld, read in zip(loaders, reads):
            ld.prepare(step)
            xc, yc = read()
            xe, ye = ld.batch(step)
            assert torch.equal(yc, ye) and yc.dtype == ye.dtype
            assert torch.equal(xc, xe) and xc.dtype == torch.float32
            assert xc.is_contiguous(memory_format=torch.channels_last) == xe.is_contiguous(
                memory_format=torch.channels_last)


@pytest.mark.parametrize("n,world,batch,acc", [(1437, 2, 24, 2), (103, 3, 4, 3), (100, 1, 8, 4)])
def test_accumulated_micro_batches_are_the_single_process_batch_across_epochs(n, world, batch, acc):
    """--accumulate N: training step s reads loader steps s*N .. s*N+N-1 on every rank; their union is
    the batch of W*N*B one process reads at step s, also past an epoch's end, where an epoch of
    W*B-batches would not be whole steps (1437 // 48 = 29 loader steps, 14 training steps of 96).
    The device counter (prepare, then N next_batch) reads the same."""
    x = torch.arange(n)
    loaders = [ShardedLoader(x, x, batch_size=batch, shard=r, num_shards=world, seed=3, normalize=lambda t: t,
                             accumulate=acc) for r in range(world)]
    single = _loaders(n, 1, world * batch * acc)[0]
    assert loaders[0].steps_per_epoch == single.steps_per_epoch * acc
    for step in range(2 * single.steps_per_epoch + 2):
        micro = [ld.batch(step * acc + k)[0] for ld in loaders for k in range(acc)]
        assert sorted(torch.cat(micro).tolist()) == sorted(single.batch(step)[0].tolist()), f"step {step}"
        for ld in loaders:
            ld.prepare(step * acc)
            got = torch.cat([ld.next_batch()[0] for _ in range(acc)])
            want = torch.cat([ld.batch(step * acc + k)[0] for k in range(acc)])
            assert torch.equal(got, want), f"step {step}, shard {ld.shard}: the device counter differs"


def test_accumulated_batch_larger_than_shard_is_bad_input():
    x = torch.arange(100)
    with pytest.raises(BadInput, match="--batch-size 30 x --accumulate 2"):
        ShardedLoader(x, x, batch_size=30, shard=0, num_shards=2, seed=0, normalize=lambda t: t, accumulate=2)
