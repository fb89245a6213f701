"""The general contract (issue 51): shmlearn.train(cfg, model=, data=, compute_loss=fn), fn(model, batch)
-> loss or (loss, metrics), over Datasets whose items have any structure.

References, not shapes: at 2 real Gloo workers the weights equal one process training plain torch on
the concatenated batches of the same global order; the reported test and validation losses and
metrics equal a direct pass over the whole split with the returned model; integer inputs reach the
model as integers; every bad input is one line (BadInput, exit 2), naming the user's line where the
user's code raised.

The classes and functions below are at the top level: spawned pool workers unpickle them by reference
(this module, from the tests folder pytest puts on sys.path).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.data.loader import epoch_permutation
from shmlearn.errors import BadInput
from shmlearn.launch.pool import Pool, using

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_TRAIN, N_VAL, N_TEST, D = 256, 40, 53, 6


class Pairs(torch.utils.data.Dataset):
    """Dict items {"x": float32 (D,), "target": float32 ()}: a linear regression with noise."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, D, generator=g)
        w = torch.arange(1, D + 1, dtype=torch.float32) / D
        self.t = self.x @ w + 0.1 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "target": self.t[i]}


def pairs():
    return Pairs(N_TRAIN, 0), Pairs(N_VAL, 1), Pairs(N_TEST, 2)


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.lin = nn.Linear(D, 1)

    def forward(self, x):
        return self.lin(x).squeeze(-1)


def mse(model, batch):
    pred = model(batch["x"])
    err = pred - batch["target"]
    return (err ** 2).mean(), {"mae": err.abs().mean()}


class Tokens(torch.utils.data.Dataset):
    """(ids int64 [T], next ids int64 [T]) windows of a sequence where token t+1 = (t + 3) % V."""

    def __init__(self, n, T=8, V=17):
        self.n, self.T, self.V = n, T, V

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = (torch.arange(self.T) * 3 + i) % self.V
        return ids, (ids + 3) % self.V


class TinyLM(nn.Module):
    def __init__(self, V=17, d=16):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, d), nn.Linear(d, V)

    def forward(self, ids):
        if ids.dtype != torch.int64:  # the contract: integer inputs stay integers
            raise TypeError(f"token ids arrived as {ids.dtype}")
        return self.out(self.emb(ids))


def lm_loss(model, batch):
    ids, nxt = batch
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), nxt.flatten())
    return loss, {"accuracy": (logits.argmax(-1) == nxt).float().mean()}


class AutoEncoder(nn.Module):
    """A VAE-like model: items are one tensor (no label), the output a tuple."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(D, 2), nn.Linear(2, D)

    def forward(self, x):
        z = self.enc(x)
        return self.dec(z), z


class Unlabelled(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def recon_loss(model, x):
    recon, z = model(x)
    rec = F.mse_loss(recon, x)
    kl = 1e-3 * (z ** 2).mean()
    return rec + kl, {"rec": rec, "kl": kl}


def unlabelled():
    return Unlabelled(200), Unlabelled(50)


def not_scalar(model, batch):
    return model(batch["x"]) - batch["target"]


def raises_inside(model, batch):
    pred = model(batch["x"])
    return pred.mean() + batch["no-such-key"]  # the user's line the message must name


def _cfg(out, **kw) -> TrainConfig:
    base = dict(device="cpu", batch_size=16, optimizer="sgd", momentum=0.0, lr=0.05, lr_schedule="constant",
                samples=N_TRAIN * 2, eval_points=2, progress=False, threads=1, out=str(out), seed=3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def pool():
    with Pool(2) as p:
        yield p


def _reference(cfg: TrainConfig, workers: int):
    """Plain torch, one process: at step s the W*B*N rows perm[s*W*B*N:(s+1)*W*B*N] of the epoch's
    global order (data/loader.py; N = --accumulate), the mean loss over them, clip_grad_norm_ on
    that gradient with --clip-grad-norm, SGD."""
    train = Pairs(N_TRAIN, 0)
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    gb = workers * cfg.batch_size * cfg.accumulate
    per_epoch = N_TRAIN // gb
    for step in range(cfg.samples // gb):
        epoch, i = divmod(step, per_epoch)
        idx = epoch_permutation(N_TRAIN, cfg.seed, epoch)[i * gb:(i + 1) * gb]
        loss, _ = mse(model, {"x": train.x[idx], "target": train.t[idx]})
        opt.zero_grad()
        loss.backward()
        if cfg.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        opt.step()
    return model


@pytest.mark.parametrize("strategy,extra", [
    ("allreduce", {}), ("ps", {}), ("ddp", {}),
    ("allreduce", {"accumulate": 2, "clip_grad_norm": 0.5}), ("ddp", {"accumulate": 2, "clip_grad_norm": 0.5}),
], ids=["allreduce", "ps", "ddp", "allreduce-accumulate-clip", "ddp-accumulate-clip"])
def test_two_workers_train_the_weights_of_one_process_on_the_concatenated_batches(tmp_path, pool, strategy, extra):
    cfg = _cfg(tmp_path / "run", workers=2, strategy=strategy, **extra)
    with using(pool):
        result = shmlearn.train(cfg, model=Linear(), data=pairs(), compute_loss=mse)
    assert result.status == "completed"
    ref = _reference(cfg, 2)
    for (name, got), want in zip(result.model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_evaluation_reports_the_mean_loss_and_metrics_of_every_split(tmp_path, pool):
    """eval_batch_size 7 splits each rank's slice unevenly: the means are weighted by rows."""
    cfg = _cfg(tmp_path / "run", workers=2, eval_batch_size=7)
    with using(pool):
        result = shmlearn.train(cfg, model=Linear(), data=pairs(), compute_loss=mse)
    model = result.model.eval()
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "eval.jsonl"))]
    assert [r["step"] for r in rows][-1] == result.summary["steps"]
    with torch.no_grad():
        for split, ds in (("val", Pairs(N_VAL, 1)), ("test", Pairs(N_TEST, 2))):
            err = model(ds.x) - ds.t
            want = {f"{split}_loss": float((err ** 2).mean()), f"{split}_mae": float(err.abs().mean())}
            for key, value in want.items():
                assert rows[-1][key] == pytest.approx(value, rel=1e-5), key
                assert result.summary[key] == pytest.approx(value, rel=1e-5), key
    assert result.summary["best_val_loss"] == min(r["val_loss"] for r in rows)
    assert result.summary["test_accuracy"] is None  # no accuracy metric: none made up


def test_integer_token_ids_reach_the_model_as_integers_and_it_learns(tmp_path):
    cfg = _cfg(tmp_path / "run", workers=1, optimizer="adam", lr=0.05, samples=6000, batch_size=32)
    result = shmlearn.train(cfg, model=TinyLM(), data=(Tokens(400), Tokens(60)), compute_loss=lm_loss)
    assert result.status == "completed"
    assert result.summary["test_accuracy"] > 0.9  # the next token is a function of the current one
    assert result.summary["best_test_accuracy"] >= result.summary["test_accuracy"]


def test_a_model_with_tuple_outputs_and_no_labels_trains_at_two_workers(tmp_path, pool):
    cfg = _cfg(tmp_path / "run", workers=2, samples=800)
    with using(pool):
        result = shmlearn.train(cfg, model=AutoEncoder(), data=unlabelled(), compute_loss=recon_loss)
    s = result.summary
    assert s["status"] == "completed" and s["test_loss"] == pytest.approx(s["test_rec"] + s["test_kl"], rel=1e-5)


def test_compute_loss_with_built_in_data_gets_the_inputs_and_targets(tmp_path):
    def_ce = "test_compute_loss:ce_pair"
    cfg = _cfg(tmp_path / "run", workers=1, model="mlp", dataset="digits", samples=2048, compute_loss=def_ce)
    result = shmlearn.train(cfg)
    assert result.status == "completed" and result.summary["test_accuracy"] > 0.8


def ce_pair(model, batch):
    x, y = batch
    out = model(x)
    return F.cross_entropy(out, y), {"accuracy": (out.argmax(1) == y).float().mean()}


@pytest.mark.parametrize("fn,want", [
    (not_scalar, "returned a loss of shape (2,); expected the batch's mean loss, one number"),
    (raises_inside, "raised KeyError: 'no-such-key' (at "),
])
def test_a_bad_compute_loss_is_one_line_before_training(tmp_path, fn, want):
    with pytest.raises(BadInput) as e:
        shmlearn.train(_cfg(tmp_path / "run", workers=1), model=Linear(), data=pairs(), compute_loss=fn)
    msg = str(e.value)
    assert "\n" not in msg and want in msg, msg
    if fn is raises_inside:
        assert f"{__file__}:" in msg and "in raises_inside" in msg, msg


OWN_PY = """
import torch, torch.nn.functional as F
from torch import nn

class Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        x = torch.full((4,), float(i % 5))
        return {"x": x, "y": i % 5}

def data():
    return Items(100), Items(30)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5)
    def forward(self, x):
        return self.lin(x)

def fn(model, batch):
    out = model(batch["x"])
    return F.cross_entropy(out, batch["y"]), {"accuracy": (out.argmax(1) == batch["y"]).float().mean()}
"""


def _shmlearn(cwd, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for k in ("RANK", "WORLD_SIZE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "shmlearn", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def test_the_cli_takes_compute_loss_by_reference_and_records_it(tmp_path):
    (tmp_path / "own.py").write_text(textwrap.dedent(OWN_PY))
    r = _shmlearn(tmp_path, "train", "--model", "own.py:Net", "--dataset", "own.py:data", "--compute-loss", "own.py:fn",
                  "--workers", "2", "--samples", "1600", "--batch-size", "10", "--device", "cpu", "--no-progress",
                  "--out", "run")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["loss"] == "own.py:fn" and summary["test_accuracy"] is not None
    assert "compute_loss: own.py:fn" in (tmp_path / "run" / "config.yaml").read_text()
    bad = _shmlearn(tmp_path, "train", "--model", "own.py:Net", "--dataset", "own.py:data", "--compute-loss",
                    "own.py:fn", "--loss", "own.py:fn", "--device", "cpu", "--out", "run2")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--compute-loss own.py:fn and --loss own.py:fn: give one" in bad.stderr


SEEN = []


class Plateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's, recording the metric of each step (a 1-worker run trains in this process)."""

    def step(self, metrics, *a, **k):
        SEEN.append((float(metrics), float(self.optimizer.param_groups[0]["lr"])))
        return super().step(metrics, *a, **k)


def plateau(optimizer):
    return Plateau(optimizer, factor=0.5, patience=0, threshold=10.0, threshold_mode="abs")


def test_reduce_lr_on_plateau_steps_on_the_validation_loss_after_each_evaluation(tmp_path):
    SEEN.clear()
    cfg = _cfg(tmp_path / "run", workers=1, eval_points=4, optimizer="SGD", optimizer_args="lr=0.05",
               momentum=None, lr_schedule="linear")
    result = shmlearn.train(cfg, model=Linear(), data=pairs(), compute_loss=mse, scheduler=plateau)
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "eval.jsonl"))]
    assert [m for m, _ in SEEN] == pytest.approx([r["val_loss"] for r in rows])
    # no evaluation improves by 10: after the first sets the best, each halves the rate
    assert [lr for _, lr in SEEN] == pytest.approx([0.05 * 0.5 ** max(0, i - 1) for i in range(len(rows))])


CALLS = {"n": 0}


def fails_at_step_three(model, batch):
    CALLS["n"] += 1  # per process: the check's call, then one per step
    if CALLS["n"] > 4:
        raise ValueError("a bug that shows only in training")
    return mse(model, batch)


def test_a_failure_in_the_users_code_inside_a_worker_shows_the_users_frames(tmp_path, pool):
    from shmlearn.errors import WorkerFailed
    with using(pool), pytest.raises(WorkerFailed) as e:
        shmlearn.train(_cfg(tmp_path / "run", workers=2), model=Linear(), data=pairs(),
                       compute_loss=fails_at_step_three)
    msg = str(e.value)
    assert msg.startswith("rank ") and "ValueError: a bug that shows only in training" in msg, msg
    assert "in your code:" in msg and f'File "{__file__}", line' in msg and "in fails_at_step_three" in msg, msg
    assert "shmlearn/step" not in msg  # the library's frames stay out


def test_early_stop_and_save_best_follow_the_monitored_value(tmp_path):
    """lr 0.6 makes the linear model's validation loss blow up after the first steps: the run stops
    `early_stop` evaluations after its best one, and best.* holds the weights that scored it."""
    cfg = _cfg(tmp_path / "run", workers=1, lr=0.6, samples=N_TRAIN * 8, eval_points=16, early_stop=2,
               save_best=True, monitor="val_mae")
    result = shmlearn.train(cfg, model=Linear(), data=pairs(), compute_loss=mse)
    s = result.summary
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "eval.jsonl"))]
    maes = [r["val_mae"] for r in rows]
    best = maes.index(min(maes))
    assert s["monitor"] == "val_mae" and s["best_step"] == rows[best]["step"] and s["best_val_mae"] == min(maes)
    assert len(rows) == best + 3 and s["stopped_early"] == rows[-1]["step"] < s["planned_steps"], (maes, s)
    best_model = shmlearn.load_model(result.run_dir, model=Linear(), best=True)
    ds = Pairs(N_VAL, 1)
    with torch.no_grad():
        assert float((best_model(ds.x) - ds.t).abs().mean()) == pytest.approx(min(maes), rel=1e-5)


def pad_collate(items):
    """A user's collate: pads variable-length id lists to the longest, and keeps the lengths."""
    longest = max(len(ids) for ids, _ in items)
    ids = torch.zeros(len(items), longest, dtype=torch.int64)
    for i, (row, _) in enumerate(items):
        ids[i, :len(row)] = torch.as_tensor(row)
    return {"ids": ids, "lengths": torch.tensor([len(r) for r, _ in items]),
            "target": torch.tensor([t for _, t in items], dtype=torch.float32)}


class Ragged(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = list(range(1 + i % 5))
        return ids, float(len(ids))


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(40):
            yield list(range(1 + i % 5)), float(1 + i % 5)


class CountIds(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, ids, lengths):
        return self.w * lengths.float()


def count_loss(model, batch):
    assert batch["ids"].dtype == torch.int64
    return ((model(batch["ids"], batch["lengths"]) - batch["target"]) ** 2).mean()


def test_a_dataloader_with_its_own_collate_an_iterable_test_set_and_a_sampler(tmp_path):
    """The train DataLoader's collate_fn pads and its sampler (every item once, odd ones first) is
    followed: at batch 5 and 1 worker the first step's batch is items 1, 3, 5, 7, 9."""
    seen = []

    class Odd(torch.utils.data.Sampler):
        def __len__(self):
            return 60

        def __iter__(self):
            return iter(list(range(1, 60, 2)) + list(range(0, 60, 2)))

    def first_batch(model, batch):
        seen.append(batch["lengths"].tolist())
        return count_loss(model, batch)

    train = torch.utils.data.DataLoader(Ragged(60), batch_size=7, collate_fn=pad_collate, sampler=Odd())
    test = torch.utils.data.DataLoader(Stream(), collate_fn=pad_collate)
    cfg = _cfg(tmp_path / "run", workers=1, batch_size=5, samples=300, lr=0.01, eval_points=1, eval_at_start="off")
    result = shmlearn.train(cfg, model=CountIds(), data=(train, test), compute_loss=first_batch)
    assert result.status == "completed"
    assert seen[1] == [1 + i % 5 for i in (1, 3, 5, 7, 9)]  # seen[0]: the check's two samples
    assert float(result.model.w.detach()) == pytest.approx(1.0, abs=0.05)  # target = length: w -> 1


def test_a_distributed_sampler_is_refused_in_one_line(tmp_path):
    ds = Ragged(20)
    train = torch.utils.data.DataLoader(ds, collate_fn=pad_collate,
                                        sampler=torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=0))
    with pytest.raises(BadInput, match="data=: a DistributedSampler shards for its own ranks"):
        shmlearn.train(_cfg(tmp_path / "run", workers=1, batch_size=2), model=CountIds(),
                       data=(train, torch.utils.data.DataLoader(Ragged(10), collate_fn=pad_collate)),
                       compute_loss=count_loss)
