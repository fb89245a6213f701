"""Two user workloads of issue 51, written as a user writes them, trained three ways on 1, 2 and 4
GPUs in one run: shmlearn.train (the API), a plain DDP loop (processes started with
torch.multiprocessing as torchrun would, NCCL, fused AdamW, bf16 autocast) and DDP + torch.compile.

    python benchmarks/user_workloads.py --gpus 1,2,4 --out results/user-workloads/h100.json
    python benchmarks/user_workloads.py --device cpu --tiny --gpus 1,2 --out /tmp/uw.json   # the harness on a CPU

The workloads (one model code for both, nanoGPT-style blocks over F.scaled_dot_product_attention):
* vit: a ViT-tiny (patch 4 on 3x32x32, d 192, depth 12, 3 heads, MLP 768: 5.4M parameters; the
  issue's 2.7M model is --vit-depth 6), classes 10, AdamW (lr 1e-3, betas 0.9/0.999, weight decay
  0.05 on matrices only), batch 256 a GPU.
* lm: a GPT-style LM (6 layers, d 384, 6 heads, sequence 256, vocabulary 8192, tied embedding),
  AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on matrices), gradient clipping at norm 1.0,
  32 sequences of 256 tokens a GPU. shmlearn takes it through the general contract
  (compute_loss=, data= Datasets of int64 tokens) and --clip-grad-norm (TrainConfig.clip_grad_norm).
Both in bf16 autocast. The data are synthetic, with a signal to learn (images: a class prototype
plus noise; tokens: a noisy affine recurrence), never zeros; the DDP loops make them on the device,
shmlearn's ranks through the data= callable (kept on the device by its loader).

Timing, the same for both: one launch, --warmup steps not timed, then --repeats windows of
--steps steps each; samples/s per window. DDP: torch.cuda.synchronize at both ends of a window.
shmlearn: one run of --warmup + repeats x --steps steps (start-up, capture and compile come before
its clock), each window's samples and training seconds from metrics.jsonl's rows at the window's
ends, which are loss reads (the device drained, real times) when --warmup and --steps are
multiples of --check-every (50 on CUDA). Median and spread
(min, quartiles, max) of the repeats; ratio = shmlearn's best variant over the best of DDP and
DDP + compile; scaling = samples/s at N GPUs over 1 GPU. The JSON is rewritten after each row.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

# --- the user's code: models, data, optimizer, loss -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """A workload's sizes (full, or --tiny for the CPU check of the harness)."""
    d: int
    depth: int
    heads: int
    mlp: int
    batch: int
    seq: int = 256
    vocab: int = 8192
    patch: int = 4


SHAPES = {"vit": Shape(d=192, depth=12, heads=3, mlp=768, batch=256),
          "lm": Shape(d=384, depth=6, heads=6, mlp=4 * 384, batch=32)}
TINY = {"vit": Shape(d=32, depth=2, heads=2, mlp=64, batch=16),
        "lm": Shape(d=32, depth=2, heads=2, mlp=64, batch=4, seq=32, vocab=256)}


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mlp: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, mlp), nn.Linear(mlp, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def gpt_init(module: nn.Module) -> None:
    """nanoGPT's initialization: weights N(0, 0.02), biases zero (a loss near ln(classes) at the start)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


class ViT(nn.Module):
    def __init__(self, s: Shape, classes: int = 10, image: int = 32):
        super().__init__()
        self.embed = nn.Conv2d(3, s.d, s.patch, s.patch)
        self.pos = nn.Parameter(torch.randn(1, (image // s.patch) ** 2, s.d) * 0.02)
        self.blocks = nn.Sequential(*[Block(s.d, s.heads, s.mlp, causal=False) for _ in range(s.depth)])
        self.norm, self.head = nn.LayerNorm(s.d), nn.Linear(s.d, classes)
        gpt_init(self)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(x)).mean(1))


class GPT(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.d), nn.Embedding(s.seq, s.d)
        self.blocks = nn.Sequential(*[Block(s.d, s.heads, s.mlp, causal=True) for _ in range(s.depth)])
        self.norm = nn.LayerNorm(s.d)
        self.lm_head = nn.Linear(s.d, s.vocab, bias=False)
        self.lm_head.weight = self.tok.weight  # tied
        gpt_init(self)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.lm_head(self.norm(self.blocks(x)))


def images(n: int, seed: int, device="cpu"):
    """n images of 3x32x32: the label's prototype (fixed by the seed) plus unit noise."""
    g = torch.Generator(device=device).manual_seed(seed)
    protos = torch.randn(10, 3, 32, 32, generator=torch.Generator(device=device).manual_seed(1234), device=device)
    y = torch.randint(0, 10, (n,), generator=g, device=device)
    return 0.5 * protos[y] + torch.randn(n, 3, 32, 32, generator=g, device=device), y


def tokens(n: int, s: Shape, seed: int, device="cpu"):
    """n sequences of s.seq + 1 token ids: t[i+1] = (7 t[i] + 3 + e) mod vocab, e in {0, 1, 2}."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.empty(n, s.seq + 1, dtype=torch.int64, device=device)
    t[:, 0] = torch.randint(0, s.vocab, (n,), generator=g, device=device)
    noise = torch.randint(0, 3, (n, s.seq), generator=g, device=device)
    for i in range(s.seq):
        t[:, i + 1] = (7 * t[:, i] + 3 + noise[:, i]) % s.vocab
    return t


def adamw(model, lr: float, betas, weight_decay: float):
    """AdamW as a transformer recipe sets it: decay on matrices only, torch's fused kernel."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=betas, fused=torch.cuda.is_available())


OPTIM = {"vit": dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.05),
         "lm": dict(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)}
CLIP = {"vit": None, "lm": 1.0}


def lm_loss(model, batch):
    """compute_loss for the LM: next-token cross-entropy over the (B, T+1) token ids."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


class TokenSet(torch.utils.data.Dataset):
    """Each item one sequence of token ids (int64), no label."""

    def __init__(self, t):
        self.t = t

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return self.t[i]


# What shmlearn's ranks call (top level: the pool's processes receive them pickled by name).
def vit_model(tiny: bool = False):
    return ViT((TINY if tiny else SHAPES)["vit"])


def lm_model(tiny: bool = False):
    return GPT((TINY if tiny else SHAPES)["lm"])


def data_size(workload: str, tiny: bool) -> int:
    """Training samples: 20,000 images (240 MB in float32; an epoch of 19 steps at 4 GPUs); 16,384
    sequences (an epoch of 128 steps at 4 GPUs); a few batches with --tiny."""
    return 256 if tiny else (20000 if workload == "vit" else 16384)


def vit_data(n: int):
    x, y = images(n, seed=0)
    tx, ty = images(1024, seed=1)
    return x, y, tx, ty


def lm_data(n: int, tiny: bool = False):
    s = (TINY if tiny else SHAPES)["lm"]
    return TokenSet(tokens(n, s, seed=0)), TokenSet(tokens(256, s, seed=1))


def vit_optimizer(model):
    return adamw(model, **OPTIM["vit"])


def lm_optimizer(model):
    return adamw(model, **OPTIM["lm"])


# --- shmlearn -------------------------------------------------------------------------------------

def needs(workload: str) -> None:
    """The LM goes through issue 51's general contract and clipping: say clearly if this shmlearn lacks them."""
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    missing = []
    if workload == "lm":
        if "compute_loss" not in inspect.signature(shmlearn.train).parameters:
            missing.append("shmlearn.train(compute_loss=...) (the general training contract)")
        if "clip_grad_norm" not in {f.name for f in dataclasses.fields(TrainConfig)}:
            missing.append("TrainConfig.clip_grad_norm (--clip-grad-norm)")
    if missing:
        sys.exit(f"user_workloads.py: the {workload} workload needs {' and '.join(missing)}, "
                 f"which this shmlearn ({os.path.dirname(shmlearn.__file__)}) does not have")


def steady_rates(run_dir: str, warmup: int, steps: int, repeats: int) -> list:
    """Samples per training second in each window [warmup + i steps, warmup + (i + 1) steps) of a
    run, from its metrics.jsonl rows at the windows' ends (loss reads: real times, when warmup and
    steps are multiples of --check-every)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        at = {r["step"]: r for r in (json.loads(line) for line in f if line.strip())}
    ends = [warmup + i * steps for i in range(repeats + 1)]
    if any(e not in at for e in ends):
        raise RuntimeError(f"{run_dir}: metrics.jsonl has no row at step {next(e for e in ends if e not in at)}")
    return [(at[b]["samples"] - at[a]["samples"]) / (at[b]["time_s"] - at[a]["time_s"]) for a, b in zip(ends, ends[1:])]


def shmlearn_runs(workload: str, n: int, variant: str, a, tmp: str) -> dict:
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    s = (TINY if a.tiny else SHAPES)[workload]
    steps = a.warmup + a.repeats * a.steps
    kw = dict(workers=n, device=a.device, batch_size=s.batch, samples=steps * s.batch * n,
              precision=a.precision, eval_points=1, eval_at_start="off", progress=False,
              compile=variant, log_every=math.gcd(a.warmup, a.steps), check_every=a.check_every, seed=0)
    given = dict(optimizer=vit_optimizer if workload == "vit" else lm_optimizer)
    pool = data_size(workload, a.tiny)
    if workload == "vit":
        given.update(model=functools.partial(vit_model, a.tiny), data=functools.partial(vit_data, pool))
    else:
        kw["clip_grad_norm"] = CLIP["lm"]
        given.update(model=functools.partial(lm_model, a.tiny), data=functools.partial(lm_data, pool, a.tiny),
                     compute_loss=lm_loss)
    res = shmlearn.train(TrainConfig(**kw, out=os.path.join(tmp, f"{workload}-w{n}-{variant}")), **given)
    summary = res.summary
    rates = steady_rates(res.run_dir, a.warmup, a.steps, a.repeats)
    return {"samples_per_s": stats(rates), "step_mode": summary.get("step_mode"), "step_note": summary.get("step_note"),
            "update_kernel": summary.get("update_kernel"), "compile": summary.get("compile"),
            "final_loss": summary.get("final_loss")}


# --- DDP, as a user writes it ----------------------------------------------------------------------

def ddp_rank(rank: int, world: int, port: int, workload: str, compiled: bool, a, result: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    cuda = a.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        torch.backends.cudnn.benchmark = True  # the ViT's patch convolution: fixed shapes
    else:  # the cores shared out, as shmlearn's CPU ranks do
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    s = (TINY if a.tiny else SHAPES)[workload]
    torch.manual_seed(0)
    model = (ViT(s) if workload == "vit" else GPT(s)).to(dev)
    opt = adamw(model, **OPTIM[workload])
    model = DDP(model, device_ids=[rank] if cuda else None, gradient_as_bucket_view=True)
    step_fn = torch.compile(model) if compiled else model
    n = data_size(workload, a.tiny) // world  # this rank's share of the data, on its device
    if workload == "vit":
        x, y = images(n, seed=rank, device=dev)
    else:
        t = tokens(n, s, seed=rank, device=dev)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32

    def step(i: int) -> None:
        idx = torch.randint(0, n, (s.batch,), device=dev)
        with torch.autocast(dev.type, dtype=dtype, enabled=a.precision == "bf16"):
            if workload == "vit":
                loss = F.cross_entropy(step_fn(x[idx]), y[idx])
            else:
                loss = lm_loss(step_fn, t[idx])
        loss.backward()
        if CLIP[workload]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP[workload])
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(a.warmup):
        step(i)
    rates = []
    for _ in range(a.repeats):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(a.steps):
            step(i)
        sync()
        rates.append(a.steps * s.batch * world / (time.perf_counter() - t0))
    if rank == 0:
        with open(result, "w") as f:
            json.dump(rates, f)
    dist.destroy_process_group()


def ddp_runs(workload: str, n: int, compiled: bool, a, tmp: str) -> dict:
    import torch.multiprocessing as mp
    from shmlearn.launch.start import free_port
    result = os.path.join(tmp, f"ddp-{workload}-{n}-{int(compiled)}.json")
    mp.start_processes(ddp_rank, args=(n, free_port(), workload, compiled, a, result), nprocs=n, join=True,
                       start_method="spawn")
    with open(result) as f:
        return {"samples_per_s": stats(json.load(f))}


# --- the table --------------------------------------------------------------------------------------

def stats(values):
    from shmlearn.bench.common import stats as _stats
    return _stats(values)


def row_for(workload: str, n: int, a, tmp: str) -> dict:
    from shmlearn.launch.pool import Pool, using
    s = (TINY if a.tiny else SHAPES)[workload]
    params = sum(p.numel() for p in (ViT(s) if workload == "vit" else GPT(s)).parameters())
    row = {"workload": workload, "gpus": n, "parameters": params, "batch_per_gpu": s.batch,
           "tokens_per_sample": s.seq if workload == "lm" else None, "shmlearn": {}}
    with Pool(list(range(n)), cuda=a.device == "cuda") as pool, using(pool):  # gone before DDP's processes start
        for v in a.variants.split(","):
            row["shmlearn"][v] = shmlearn_runs(workload, n, v, a, tmp)
    row["ddp"] = ddp_runs(workload, n, False, a, tmp)
    if not a.no_compile_baseline:
        row["ddp_compile"] = ddp_runs(workload, n, True, a, tmp)
    best_ours = max(r["samples_per_s"]["median"] for r in row["shmlearn"].values())
    best_ddp = max(row[k]["samples_per_s"]["median"] for k in ("ddp", "ddp_compile") if k in row)
    row["shmlearn_best"], row["ddp_best"], row["ratio"] = best_ours, best_ddp, best_ours / best_ddp
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="vit,lm")
    ap.add_argument("--gpus", default="1,2,4", help="worker counts; those above the GPUs present are left out")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny models and batches: the harness on a CPU")
    ap.add_argument("--precision", default=None, help="bf16 (default on CUDA) or fp32 (default on the CPU)")
    ap.add_argument("--variants", default="off,default", help="shmlearn's --compile values to run")
    ap.add_argument("--no-compile-baseline", action="store_true", help="leave DDP + torch.compile out")
    ap.add_argument("--warmup", type=int, default=50, help="steps not timed (a multiple of --check-every)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps a window (a multiple of --check-every)")
    ap.add_argument("--repeats", type=int, default=5, help="timed windows a launch")
    ap.add_argument("--check-every", type=int, default=None, help="shmlearn's; default its own (50 on CUDA)")
    ap.add_argument("--vit-depth", type=int, default=None, help="12 (5.4M parameters); 6 is the issue's 2.7M model")
    ap.add_argument("--out", default="user_workloads.json")
    a = ap.parse_args(argv)
    a.precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    if a.vit_depth:
        SHAPES["vit"] = dataclasses.replace(SHAPES["vit"], depth=a.vit_depth)
    have = torch.cuda.device_count() if a.device == "cuda" else os.cpu_count() or 1
    counts = [n for n in (int(v) for v in a.gpus.split(",")) if n <= have]
    if not counts:
        sys.exit(f"--gpus {a.gpus}: this machine has {have} {'GPUs' if a.device == 'cuda' else 'cores'}")
    a.gpus_max = max(counts)
    workloads = a.workloads.split(",")
    for w in workloads:
        needs(w)
    from shmlearn.bench.common import environment
    doc = {"benchmark": "user-workloads", "environment": environment("nccl" if a.device == "cuda" else "gloo"),
           "command": "python " + " ".join(sys.argv), "args": {k: v for k, v in vars(a).items()}, "rows": []}
    tmp = tempfile.mkdtemp(prefix="user-workloads-")
    for w in workloads:
        for n in counts:
            row = row_for(w, n, a, tmp)
            one = next((r for r in doc["rows"] if r["workload"] == w and r["gpus"] == 1), None)
            if one is not None:
                row["scaling"] = {"shmlearn": row["shmlearn_best"] / one["shmlearn_best"],
                                  "ddp": row["ddp_best"] / one["ddp_best"]}
            doc["rows"].append(row)
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
            unit = "seq" if w == "lm" else "img"
            parts = [f"shmlearn {k} {v['samples_per_s']['median']:.0f} ({v['step_mode']})"
                     for k, v in row["shmlearn"].items()]
            parts += [f"{k} {row[k]['samples_per_s']['median']:.0f}" for k in ("ddp", "ddp_compile") if k in row]
            print(f"{w} x{n}: {unit}/s " + ", ".join(parts) + f"; ratio {row['ratio']:.2f}"
                  + (f", scaling {row['scaling']['shmlearn']:.2f}" if "scaling" in row else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
