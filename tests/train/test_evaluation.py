"""Evaluation that costs what it should (issue 41): the pass before training counted in
eval_time_s and switchable; the default schedule under ~10% of the run; --eval-points exact."""
import json

import pytest

import shmlearn
from shmlearn.train import evaluation
from shmlearn.config.train_config import TrainConfig


def _evals(run_dir):
    return [json.loads(l) for l in open(f"{run_dir}/eval.jsonl")]


def test_the_default_count_keeps_evaluation_under_a_tenth_of_the_run():
    assert evaluation.count(total_s=100.0, cost_s=0.01) == evaluation.EVAL_MAX
    assert evaluation.count(total_s=9.0, cost_s=1.0) == 1  # 1 s of 10: exactly the share
    assert evaluation.count(total_s=1.0, cost_s=5.0) == 1  # the last one is the run's result: always
    for total, cost in ((100.0, 1.0), (50.0, 2.0), (10.0, 0.3)):
        n = evaluation.count(total, cost)
        assert n * cost <= evaluation.EVAL_SHARE * (total + n * cost) + 1e-9


def test_due_spreads_the_middle_evaluations_over_the_projected_time():
    kw = dict(steps=100, cost_s=0.1, test_per_rank=1000, batch_size=32)
    # 10 s of training projected; count(10, 0.1) = 10 - 1 (start) - 1 (end) = 8 in the middle
    wanted = [d for d in range(1, 100) if evaluation.due(done=d, train_s=d * 0.1, eval_steps=[0], **kw)]
    assert wanted[0] == 12  # first at 1/9 of the run
    assert not evaluation.due(done=100, train_s=10.0, eval_steps=[0], **kw)  # the end is made anyway
    assert not evaluation.due(done=50, train_s=5.0, eval_steps=[0] + list(range(1, 9)), **kw)  # 8 made
    # an expensive evaluation: none in the middle
    assert not any(evaluation.due(done=d, train_s=d * 0.1, eval_steps=[0], steps=100, cost_s=5.0,
                                  test_per_rank=1000, batch_size=32) for d in range(1, 100))


def test_eval_at_start_off_and_eval_points_exact(tmp_path):
    cfg = TrainConfig(workers=1, threads=1, samples=32 * 40, eval_points=3, eval_at_start="off", progress=False,
                      out=str(tmp_path / "off"))
    res = shmlearn.train(cfg)
    assert [e["step"] for e in _evals(res.run_dir)] == [13, 27, 40]
    assert res.summary["evaluations"] == 3 and res.summary["eval_at_start"] == "off"


def test_the_pass_before_training_counts_as_evaluation(tmp_path):
    res = shmlearn.train(TrainConfig(workers=1, threads=1, samples=32 * 20, progress=False, out=str(tmp_path / "on")))
    evals = _evals(res.run_dir)
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 20
    assert res.summary["eval_schedule"] == "auto"
    assert res.summary["evaluations"] == len(evals) <= evaluation.EVAL_MAX
    assert res.summary["eval_time_s"] > 0


def test_eval_at_start_takes_on_or_off(tmp_path):
    with pytest.raises(shmlearn.BadInput, match="--eval-at-start maybe: choose on or off"):
        shmlearn.train(TrainConfig(eval_at_start="maybe", out=str(tmp_path / "x")))


def test_an_evaluation_on_a_gpu_picks_cudnns_algorithms_untimed_and_puts_the_steps_tuning_back():
    """evaluation.untimed_convolutions: --cudnn-benchmark's timing is off during an evaluation on
    CUDA and on again after it, an error included; on the CPU, or with the timing off, nothing
    changes. (The flag is torch's global: no GPU is needed to see it set.)"""
    import pytest
    import torch
    from torch.backends import cudnn
    from shmlearn.train.evaluation import untimed_convolutions
    before = cudnn.benchmark
    try:
        cudnn.benchmark = True
        with untimed_convolutions(torch.device("cuda", 0)):
            assert cudnn.benchmark is False
        assert cudnn.benchmark is True
        with pytest.raises(RuntimeError):
            with untimed_convolutions(torch.device("cuda", 0)):
                raise RuntimeError("a failing evaluation")
        assert cudnn.benchmark is True
        with untimed_convolutions(torch.device("cpu")):
            assert cudnn.benchmark is True
        cudnn.benchmark = False
        with untimed_convolutions(torch.device("cuda", 0)):
            assert cudnn.benchmark is False
        assert cudnn.benchmark is False
    finally:
        cudnn.benchmark = before
