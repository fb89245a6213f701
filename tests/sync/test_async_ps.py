"""async-ps (issue 17): staleness 0 is the dedicated parameter server bit for bit; staleness S
lags every gradient after the first S by exactly S updates, recorded per worker; it learns."""
import json

import pytest
import torch

import shmlearn
from shmlearn.config import TrainConfig, validate
from shmlearn.errors import BadInput


def _run(tmp_path, name, **kw):
    cfg = dict(dataset="digits", model="mlp", workers=2, samples=2 * 32 * 40, eval_points=2, log_every=1,
               progress=False, out=str(tmp_path / name))
    cfg.update(kw)
    res = shmlearn.train(TrainConfig(**cfg))
    losses = [json.loads(line)["loss"] for line in open(tmp_path / name / "metrics.jsonl")]
    return res, losses


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])  # the fast step (losses read every 10), classic
def test_staleness_0_is_the_dedicated_parameter_server_bit_for_bit(tmp_path, optimizer):
    ps, ps_losses = _run(tmp_path, "ps", strategy="ps", ps_dedicated=True, optimizer=optimizer, lr=0.01)
    ap, ap_losses = _run(tmp_path, "async", strategy="async-ps", staleness=0, optimizer=optimizer, lr=0.01)
    assert ap.summary["step_mode"] == ps.summary["step_mode"]
    assert ap_losses == ps_losses and len(ap_losses) == 40
    for a, b in zip(ap.model.parameters(), ps.model.parameters()):
        assert torch.equal(a, b)
    assert ap.summary["test_accuracy"] == ps.summary["test_accuracy"]
    assert (ap.summary["workers"], ap.summary["processes"]) == (2, 3)
    assert ap.summary["staleness_histogram"] == {"1": {"0": 40}, "2": {"0": 40}}
    assert {"wait", "average", "update", "pull"} <= set(ap.summary["phase_s"])  # the server's phases


def test_staleness_s_lags_each_gradient_by_s_updates_and_records_it(tmp_path):
    res, losses = _run(tmp_path, "s3", strategy="async-ps", staleness=3)
    s = res.summary
    assert s["strategy_params"] == {"staleness": 3}
    # the first S gradients were computed on the weights every rank started from (version 0)
    assert s["staleness_histogram"] == {w: {"0": 1, "1": 1, "2": 1, "3": 37} for w in ("1", "2")}
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_staleness_2_on_three_workers_learns_digits(tmp_path):
    """Issue 17, acceptance 2: shmlearn train --strategy async-ps --workers 3 --staleness 2."""
    res = shmlearn.train(TrainConfig(strategy="async-ps", workers=3, staleness=2, progress=False,
                                     out=str(tmp_path / "run")))
    assert res.summary["test_accuracy"] >= 0.95, res.summary["test_accuracy"]


def test_what_async_ps_cannot_run_with_is_refused_in_one_line():
    with pytest.raises(BadInput, match="--checkpoint-every: not supported with --strategy async-ps"):
        validate(TrainConfig(strategy="async-ps", checkpoint_every="10"))
    with pytest.raises(BadInput, match="--staleness -1: expected a whole number"):
        validate(TrainConfig(strategy="async-ps", staleness=-1))


def test_simulate_predicts_async_ps_as_the_dedicated_server_at_staleness_0_and_hides_the_server_above():
    from shmlearn.simulate import Compute, Machine, Network, predict
    from shmlearn.sync import registry
    c = Compute(data_s=0.001, compute_s=0.010, update_s=0.002, other_s=0.0, batch_size=32, parameters=10**6,
                model="m", device="cpu", source="test")
    m = Machine(compute=c, net=Network.assumed(10.0, 20.0, "test"), check_every=1)
    ded, s0 = predict(m, "ps-dedicated", 4), predict(m, "async-ps", 4)
    assert s0["step_s"] == pytest.approx(ded["step_s"])
    assert s0["push"] == pytest.approx(ded["gather"]) and s0["pull"] == pytest.approx(ded["broadcast"])
    s2 = predict(m, "async-ps", 4, registry.get("async-ps").params_of({"staleness": 2}))
    assert s2["step_s"] < s0["step_s"]


@pytest.mark.parametrize("fault,timeout_s", [("kill:2:20", 60), ("stop:1:20", 60)])
def test_a_dead_or_hung_worker_is_named_and_never_hangs_the_server(tmp_path, fault, timeout_s):
    import os
    import subprocess
    import sys
    import time
    env = dict(os.environ, SHMLEARN_FAULT=fault, PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "shmlearn", "train", "--strategy", "async-ps", "--workers", "2",
                        "--staleness", "2", "--samples", "8192", "--timeout", "5", "--no-progress",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=timeout_s)
    assert r.returncode == 1, r.stderr
    rank = fault.split(":")[1]
    assert f"rank {rank}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 45  # the server gave up after --timeout, it did not wait forever
