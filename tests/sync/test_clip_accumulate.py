"""--clip-grad-norm and --accumulate against a plain single-process torch loop (issue 51).

W real Gloo processes train STEPS steps of W x B x N samples (N micro-batches of B per worker,
--accumulate N); the reference is one process's torch loop on the same G = W*B*N samples a step
(F.cross_entropy, torch.nn.utils.clip_grad_norm_ on the whole batch's gradient, torch's SGD with
momentum), reading the batches from the loader's global permutation itself. G is the same in
every case, and the run crosses an epoch's end (the micro-batches of a step must still be the
reference's batch there). The final weights must agree to float tolerance, in the classic step
(check_every 1) and the CPU's fast step (check_every > 1: fused SGD, the loss in the collective,
the flat update; with --grad-buckets on, the average in buckets on the last micro-batch).
"""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shmlearn.config.train_config import TrainConfig, validate
from shmlearn.errors import BadInput
from shmlearn.data import load_dataset, normalizer
from shmlearn.data.loader import epoch_permutation
from shmlearn.launch.start import DistEnv, free_port
from shmlearn.models import build_model
from shmlearn.train.entry import run_worker
from cli_inproc import run_main
from procs import processes

G = 96  # samples a step, every case: an epoch of digits (1437 training samples) is 14 steps, and
# 29 (not 28) loader steps of 48: an accumulating loader must round its epoch to whole steps
STEPS = 16
LR, CLIP = 0.1, 0.2
FAST = {"check_every": 4}
CLASSIC = {"check_every": 1}
KINDS = {"clip": (1, CLIP), "acc": (2, None), "both": (2, CLIP)}


def _cases(world, kinds):
    """(strategy, kind, extra config) for each run of one process group."""
    out = []
    for kind in kinds:
        for mode in (CLASSIC, FAST):
            out += [("allreduce", kind, mode), ("ps", kind, mode)]
        out.append(("ddp", kind, CLASSIC))  # DDP has no fast step
    out.append(("allreduce", "both", dict(FAST, grad_buckets="on")))
    if world == 2:  # a server and one worker: async-ps at staleness 0 is the synchronous server
        out.append(("async-ps", "both", {}))
        # K=1: exact; clipping is each worker's own (the reference clips each shard's gradient)
        out += [("weight-avg", kind, mode) for kind in ("acc", "clip") for mode in (CLASSIC, FAST)]
    return out


def _workers(strategy, world):
    return world - 1 if strategy == "async-ps" else world


def _cfg(out, strategy, kind, world, **extra):
    n, clip = KINDS[kind]
    w = _workers(strategy, world)
    return TrainConfig(model="mlp", dataset="digits", strategy=strategy, optimizer="momentum", lr=LR,
                       lr_schedule="constant", batch_size=G // (w * n), accumulate=n, clip_grad_norm=clip,
                       samples=STEPS * G, workers=w, eval_points=1, eval_at_start="off", progress=False, save_model=False,
                       out=str(out), **extra)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _count_ddp_reductions(calls):
    """DDP's bucket all-reduces go through a hook that counts them (one bucket: the mlp is small)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from shmlearn.sync import ddp
    setup = ddp.DDP.setup

    def counted(self, *a, **k):
        setup(self, *a, **k)
        self._ddp.register_comm_hook(None, lambda state, bucket: calls.append(1) or allreduce_hook(self.group, bucket))
    ddp.DDP.setup = counted


def _worker(rank, world, port, tmp, cases):
    torch.set_num_threads(1)
    calls = []
    _count_ddp_reductions(calls)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                  launcher="local", master_port=port)
    for i, (strategy, kind, extra) in enumerate(cases):
        calls.clear()
        res = run_worker(_cfg(os.path.join(tmp, f"run{i}"), strategy, kind, world, threads=1, **extra), env)
        torch.save(_flat(res.model), os.path.join(tmp, f"case{i}-rank{rank}.pt"))
        if rank == 0:
            with open(os.path.join(tmp, f"case{i}.json"), "w") as f:
                json.dump(dict(res.summary, ddp_reductions=len(calls)), f)
    dist.destroy_process_group()
    os._exit(0)  # as test_equivalence's workers leave


def _reference(clip, shards=1):
    """The plain loop: final weights, and the gradient's norm before clipping at every step.
    shards > 1: weight-avg's clipping, each worker's gradient (of its block of the step's batch)
    clipped alone, then their mean (with K=1 the mean of the replicas' momentum steps is the
    momentum step of the mean gradient)."""
    data = load_dataset("digits")
    torch.manual_seed(0)  # the run's --seed: the same initial weights
    model = build_model("mlp", data.spec)
    norm = normalizer(data, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    n = len(data.train_x)
    per_epoch = n // G
    norms = []
    for s in range(STEPS):
        epoch, j = divmod(s, per_epoch)
        idx = epoch_permutation(n, 0, epoch)[j * G:(j + 1) * G]
        grads = []
        for part in idx.chunk(shards):
            opt.zero_grad()
            F.cross_entropy(model(norm(data.train_x[part])), data.train_y[part]).backward()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *g in zip(model.parameters(), *grads):
            p.grad = torch.stack(g).mean(0)
        opt.step()
    return _flat(model), norms


@pytest.mark.parametrize("world,kinds", [(2, ("clip", "acc", "both")), (4, ("both",))])
def test_clip_and_accumulate_match_single_process(tmp_path, world, kinds):
    cases = _cases(world, kinds)
    processes(_worker, (world, free_port(), str(tmp_path), cases), world)
    refs = {clip: _reference(clip) for clip in (None, CLIP)}
    refs["local"] = _reference(CLIP, shards=world)
    norms = refs[CLIP][1]
    assert min(norms) > 2 * CLIP, f"the bound never clips: the test proves nothing ({norms})"
    torch.manual_seed(0)
    start = _flat(build_model("mlp", load_dataset("digits").spec))
    # Clipping and accumulation change the result (else matching the reference proves nothing).
    assert (refs[CLIP][0] - refs[None][0]).abs().max() > 1e-3
    assert (refs[CLIP][0] - refs["local"][0]).abs().max() > 1e-3, "local clipping is global clipping here"
    for i, (strategy, kind, extra) in enumerate(cases):
        n, clip = KINDS[kind]
        what = f"{strategy} {kind} {extra}"
        ranks = [torch.load(os.path.join(tmp_path, f"case{i}-rank{r}.pt")) for r in range(world)]
        for r in range(1, world):
            torch.testing.assert_close(ranks[r], ranks[0], rtol=0, atol=1e-6, msg=f"{what}: rank {r} differs")
        ref = refs["local"] if strategy == "weight-avg" and clip else refs[clip]
        torch.testing.assert_close(ranks[0], ref[0], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what} vs the single-process loop: {m}")
        assert (ranks[0] - start).abs().max() > 1e-2, f"{what}: training did not move the weights"
        s = json.load(open(os.path.join(tmp_path, f"case{i}.json")))
        w = _workers(strategy, world)
        assert (s["steps"], s["samples_seen"], s["accumulate"], s["clip_grad_norm"]) == (STEPS, STEPS * G, n, clip)
        assert s["samples_per_s"] == pytest.approx(STEPS * G / s["wall_time_s"])
        assert s["batch_size"] * w * n == G
        fast = extra.get("check_every", 1) > 1
        assert s["step_mode"] == ("free-running" if strategy == "async-ps" else "fast-eager" if fast else "classic")
        if fast and strategy in ("allreduce", "ps"):  # the flat SGD kernel applies the clipped gradient
            assert s["update_kernel"] == "flat", what
        if strategy == "ddp":  # one all-reduce a step: the first N-1 backwards ran under no_sync
            assert s["ddp_reductions"] == STEPS, what
        if extra.get("grad_buckets") == "on":
            assert s["grad_buckets"] >= 1, what


@pytest.mark.parametrize("flag,value", [("--clip-grad-norm", "0"), ("--clip-grad-norm", "nan"),
                                        ("--accumulate", "0")])
def test_bad_clip_or_accumulate_is_one_line(capfd, monkeypatch, tmp_path, flag, value):
    r = run_main(["train", flag, value, "--out", str(tmp_path / "run")], monkeypatch, capfd)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{flag} {value}" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_a_step_counts_its_micro_batches_in_the_budget():
    cfg = TrainConfig(workers=2, batch_size=16, accumulate=4, samples=100)
    with pytest.raises(BadInput, match=r"--samples 100: smaller than one step of 2 workers x 16 samples x 4 micro"):
        cfg.budget_samples(1437)
    assert TrainConfig(workers=2, batch_size=16, accumulate=4, samples=256).budget_samples(1437) == 256
    with pytest.raises(BadInput, match="--accumulate 2 with --noise-scale"):
        validate(TrainConfig(accumulate=2, noise_scale=True))
