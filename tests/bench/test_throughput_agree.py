"""Every rank of `bench throughput` times the same number of steps in a repeat (Gloo, 2 ranks)."""
from shmlearn.bench.throughput_rank import agreed_steps_per_repeat, steps_per_repeat
from shmlearn.launch.pool import run_local


def _choose(env, per_step: float):
    import torch
    import torch.distributed as dist

    def agree_max(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()
    # As two `local` ranks of resnet18 at 2 H200s chose: rank 0 a sampling period of 512 steps,
    # rank 1 of 256 (each a world of one, measuring its own eager/replay ratio).
    period = 512 if env.rank == 0 else 256
    return steps_per_repeat(0.2, per_step, period), agreed_steps_per_repeat(0.2, per_step, period, agree_max)


def test_ranks_that_choose_different_periods_time_the_same_steps():
    alone = [steps_per_repeat(0.2, 7.5e-3, 512), steps_per_repeat(0.2, 7.5e-3, 256)]
    assert alone == [27, 256]  # what each rank ran before: rank 0's 27 recorded, rank 1's 256 timed
    got = run_local(_choose, (7.5e-3,), 2, cuda=False, timeout_s=120)
    assert [own for own, _ in got] == alone
    assert [agreed for _, agreed in got] == [256, 256]
