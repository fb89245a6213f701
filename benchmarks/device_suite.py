"""Run a list of GPU parts back to back on a leased device machine, detached, and collect them
call by call, so the GPUs never wait on the person (or agent) between device-tool calls.

    # first call: start every part in the background, then wait for the first ones
    python benchmarks/device_suite.py start --parts env,tput-alexnet,tput-resnet34,validation,sweep,cnn,cpu-vs-gpu
    python benchmarks/device_suite.py collect --parts env,tput-alexnet,tput-resnet34,validation --wait 540 --out $OUT
    # next calls: wait for the next parts (if the machine was given back meanwhile, collect
    # starts the runner again on what is not done)
    python benchmarks/device_suite.py collect --parts sweep --wait 560 --out $OUT --all <same list>

Each part runs in its own process group with its own time limit (a part that hangs costs only
itself), writes into ROOT/<part>/ and leaves ROOT/<part>.done (exit code, seconds). `collect`
packs each requested part's folder into OUT/<part>.tar.gz (the device tool returns at most 8
files), without Chrome traces and checkpoints, and prints the end of each part's log.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT_DIR = os.path.dirname(HERE)
FASHION = "/usr/share/datasets/fashion-mnist"


def _py(*args):
    return [sys.executable, *args]


SEED_GRID = ("--model", "alexnet-small", "--dataset", "fashion-mnist", "--samples", "307200",
             "--optimizer", "sgd", "--weight-decay", "0.004", "--lr-schedule", "constant",
             "--init", "uniform:0.05", "--eval-points", "5", "--device", "cuda", "--workers", "1",
             "--batch-size", "16,32,64,128,256,512", "--lr", "0.1:0.9:0.1")
"""Seeds 000/002 §5: batch 16..512 x lr 0.1..0.9, 307,200 samples, alexnet-small with the seed's
uniform init and L2 (plain SGD: the seed's 0.9 momentum goes with its lr 0.001, seed 001)."""


def _inductor_knobs(*mods: str) -> list:
    """Those of the bench modifiers `mods` (each a + list) whose Inductor options this torch has."""
    import torch._inductor.config as config
    if ROOT_DIR not in sys.path:  # run as a script from benchmarks/
        sys.path.insert(0, ROOT_DIR)
    from shmlearn.bench.throughput import MODIFIERS
    known = set(config._config) if hasattr(config, "_config") else set(dir(config))
    return [m for m in mods if all(k in known for part in m.split("+")
                                   for k, _ in MODIFIERS[part].get("inductor", ()))]


def _gpu_bench(folder: str, runs) -> list:
    """Issue 18: `bench throughput` on one GPU (bf16, channels_last, 5 repeats of 0.2 s), one
    process and one JSON (folder/throughput-MODEL-bBATCH.json) per (model, input, batch,
    baselines, strategies) in `runs`, in order: a part that runs out of time keeps what finished."""
    return ["bash", "-c", "; ".join(
        shlex.join(_py("-m", "shmlearn", "bench", "throughput", "--device", "cuda", "--workers", "1",
                       "--model", model, "--input", shape, "--batch-sizes", str(batch), "--baselines", baselines,
                       "--strategies", strategies, "--precision", "bf16", "--channels-last", "--repeats", "5",
                       "--seconds", "0.2", "--out", os.path.join(folder, f"throughput-{model}-b{batch}.json")))
        for model, shape, batch, baselines, strategies in runs)]


MAX4 = "plain,graph,compile,compile-max"
"""Every baseline of issue 18: plain, the plain step in a CUDA graph, torch.compile's two modes."""
STEP_VARIANTS = ("allreduce,allreduce:compile,allreduce:compile+accumulate,allreduce:compile+aten-pool,"
                 "allreduce:compile+cudnn-conv+aten-pool+accumulate")
"""The compiled step with its defaults, with each of issue 18's third-round changes undone, and all of them."""
FLAT_VARIANTS = "allreduce,allreduce:compile,allreduce:compile+torch-sgd"
"""The step with the flat SGD kernel (the default on CUDA), eager in a graph and compiled, and
compiled with torch's fused SGD instead."""
FINAL_VARIANTS = "allreduce,allreduce:compile,allreduce:compile+unfused-head,allreduce:compile+torch-sgd"
"""The step with every default (eager kernels in a graph; compiled), then compiled with the head
unfused (--mlp-head off) and with torch's fused SGD, each change undone alone."""
OVERLAP_VARIANTS = "allreduce:compile+all-conv,allreduce:compile+serial-conv,allreduce:all-conv,allreduce:serial-conv"
"""Sixth round, first run: every convolution's backward GEMMs on two streams (then the default,
now --conv-overlap all), compiled and eager in a graph, each against the one call (off)."""
OVERLAP2_VARIANTS = "allreduce:compile,allreduce:compile+serial-conv,allreduce:compile+all-conv"
"""Second run: the default (--conv-overlap auto: then up to 131072 rows), against off and all.
The third (tput-overlap3-resnet) has auto at today's 8192 rows against off."""
DEFER_VARIANTS = ("allreduce:compile,allreduce:compile+joined-conv,allreduce:compile+all-conv,"
                  "allreduce:compile+all-conv+joined-conv,allreduce:compile+serial-conv")
"""Seventh round: the default (--conv-overlap auto = small, weight GEMMs deferred to the end of the
backward), the same joined in each op (the sixth round's default), every convolution deferred,
every convolution joined, and off."""
AGREE_DEFER = (
    ("resnet18", 128, "compiled", "allreduce:compile+serial-conv,allreduce:compile+joined-conv,allreduce:compile,"
                                  "allreduce:compile+all-conv"),
    ("resnet18", 128, "eager", "allreduce:serial-conv,allreduce:joined-conv,allreduce,allreduce:all-conv"),
    ("resnet34", 1024, "compiled", "allreduce:compile+serial-conv,allreduce:compile+all-conv"))
"""agree-defer: (model, batch, kind, variants) of benchmarks/step_agreement.py, the first variant the reference."""
AGREE_EARLY = (
    ("resnet18", 128, "compiled", "allreduce:compile+no-combo+late-update,allreduce:compile+no-combo,"
                                  "allreduce:compile+no-combo+joined-conv"),
    ("resnet18", 128, "eager", "allreduce:late-update,allreduce"),
    ("resnet34", 128, "compiled", "allreduce:compile+no-combo+late-update,allreduce:compile+no-combo"))
"""Eighth round: the update in the backward (the default) against the update after it, bit for bit
with deterministic cuDNN (combo kernels off: their own autotuning sums in another order)."""
AGREE_COPY = (
    ("resnet18", 128, "compiled", "allreduce:compile+no-combo+no-weight-copy,allreduce:compile+no-combo,"
                                  "allreduce:compile+no-combo+late-update"),
    ("resnet18", 128, "eager", "allreduce:no-weight-copy,allreduce,allreduce:late-update"),
    ("resnet34", 128, "compiled", "allreduce:compile+no-combo+no-weight-copy,allreduce:compile+no-combo"))
"""Eleventh round: the weights' bf16 copy written by the update (--weight-copy auto, the default)
against the forward's own casts, with the update in the backward (whose input-gradient GEMMs
read the copy that the update then writes) and after it, bit for bit."""
DEFER2_VARIANTS = ("allreduce:compile,allreduce:compile+2-streams,allreduce:compile+combo,allreduce:compile+aggressive,"
                   "allreduce:compile+no-split,allreduce:compile+serial-conv")
"""Seventh round, second run: the new default (--conv-overlap auto = all, deferred), with the weight
GEMMs on two side streams in turn, with Inductor's combo kernels, with its aggressive fusion,
without its split reductions, and off."""
CONV_POOL_VARIANTS = "allreduce,allreduce:unfused,allreduce:compile,allreduce:compile+unfused"
"""The step (eager in a CUDA graph, and compiled) with its defaults (--conv-pool auto: fused on
CUDA) and with the blocks unfused (--conv-pool off: the third round's defaults)."""


def _scale_bench(folder: str, workers: str, runs, baselines: str = "local,ddp,ddp-compile") -> list:
    """`bench throughput` at every GPU count in `workers`, shmlearn's compiled step against
    `baselines` (local, DDP and DDP + compile), one process tree and one JSON per (model, batch), in order."""
    return ["bash", "-c", "; ".join(
        shlex.join(_py("-m", "shmlearn", "bench", "throughput", "--device", "cuda", "--workers", workers,
                       "--model", model, "--batch-sizes", str(batch), "--baselines", baselines,
                       "--strategies", compiled if isinstance(compiled, str) else
                       ("allreduce:compile" if compiled else "allreduce"), "--precision", "bf16",
                       "--channels-last", "--repeats", "5", "--seconds", "0.2",
                       "--out", os.path.join(folder, f"scale-{model}-b{batch}.json")))
        for model, batch, compiled in runs)]


def _avx_abort(folder: str) -> str:
    show = ("import re,sys; t=open(sys.argv[1],errors='replace').read(); "
            "m=re.findall(r'Current thread.*?File \"(/[^\"]*torchinductor[^\"]*[.]py)\", line ([0-9]+)', t, re.S); "
            "[print('#### %s:%s' % (f, n), *open(f).read().splitlines()[max(0, int(n) - 60):int(n) + 3], sep=chr(10)) "
            "for f, n in m[:2]]")
    cmds = []
    for cap in ("avx512", "avx2"):
        log = os.path.join(folder, f"{cap}.txt")
        cmds.append(f"CUDA_VISIBLE_DEVICES= ATEN_CPU_CAPABILITY={cap} OMP_NUM_THREADS=4 "
                    f"TORCHINDUCTOR_CACHE_DIR=/tmp/ind-{cap} timeout 250 python3 -X faulthandler -m pytest -q "
                    f"-p no:cacheprovider -p no:xdist --tb=long -rfE tests/nn/test_conv_overlap.py > {log} 2>&1; "
                    f"echo {cap} rc=$?; python3 -c {shlex.quote(show)} {log} > {folder}/{cap}-code.txt 2>&1; "
                    f"grep -E 'passed|failed|Fatal' {log} | tail -3")
    cmds.append("python3 -c 'import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability()); "
                "from torch._inductor import cpu_vec_isa as v; print(v.pick_vec_isa())'; lscpu | grep -i 'model name\\|flags' | cut -c1-400")
    return "; ".join(cmds)


def _probe_42(folder: str, gpus: str) -> str:
    n = int(gpus)
    probe = [sys.executable, os.path.join(HERE, "multi_gpu_probe.py"), "--steps", "100", "--repeats", "3"]
    ws = ",".join(str(w) for w in (1, 2, 4) if w <= n)
    j = lambda label, *extra: shlex.join(probe + ["--label", label, "--out", os.path.join(folder, f"{label}.json"),
                                                  *extra])  # noqa: E731
    cmds = [f"(nvidia-smi dmon -s pucv -d 1 > {folder}/dmon.txt 2>&1 &)",
            j("base", "--workers", ws), j("thr4", "--workers", str(n), "--threads", "4"),
            j("pin", "--workers", str(n), "--threads", str(max(1, (os.cpu_count() or 4) // max(n, 1))), "--pin"),
            " & ".join(f"CUDA_VISIBLE_DEVICES={i} " + j(f"indep{i}", "--workers", "1", "--variants", "graph,local")
                       for i in range(n)) + " & wait",
            j("trace", "--workers", "2", "--variants", "local,allreduce", "--repeats", "1",
              "--trace", os.path.join(folder, "traces")),
            "pkill -x nvidia-smi || true"]
    return "; ".join(cmds)


def _r18_diag(folder: str, gpus: str) -> str:
    n = int(gpus)
    base = ["-m", "shmlearn", "train", "--device", "cuda", "--model", "resnet18", "--dataset", "synthetic-32",
            "--precision", "fp32", "--strategy", "ps", "--workers", "1", "--batch-size", "64", "--samples", "6400",
            "--lr", "0.02", "--eval-points", "1", "--seed", "0", "--no-progress"]
    ref = ["--compile", "off", "--cuda-graph", "off", "--conv-pool", "off", "--mlp-head", "off",
           "--image-conv", "cudnn", "--max-pool", "aten", "--conv-overlap", "off", "--update-in-backward", "off",
           "--weight-copy", "off", "--check-every", "1"]
    runs = {"ref": ref, "ref-again": ref, "cell": ["--compile", "default"],
            "cell-again": ["--compile", "default"], "no-compile": [],
            "compile-allreduce": ["--compile", "default", "--strategy", "allreduce"],
            "compile-no-graph": ["--compile", "default", "--cuda-graph", "off"],
            "compile-overlap-off": ["--compile", "default", "--conv-overlap", "off"],
            "compile-early-off": ["--compile", "default", "--update-in-backward", "off"],
            "compile-copy-off": ["--compile", "default", "--weight-copy", "off"],
            "compile-cudnn-aten": ["--compile", "default", "--image-conv", "cudnn", "--max-pool", "aten"],
            "compile-check1": ["--compile", "default", "--check-every", "1"],
            "compile-all-off": ["--compile", "default"] + ref[4:],
            "ref-compile-only": ["--compile", "default"] + ref[2:]}
    jobs = []
    for k, (name, extra) in enumerate(runs.items()):
        out = os.path.join(folder, name)
        jobs.append(f"(CUDA_VISIBLE_DEVICES={k % n} {shlex.join(_py(*base, *extra, '--out', out))} "
                    f"> {out}.log 2>&1; echo {name} rc=$? $(python3 -c \"import json; s=json.load(open('{out}/summary.json')); "
                    f"print(s.get('final_loss'), s.get('step_mode'), s.get('compile'))\" 2>&1 | tail -1)) &")
    return " ".join(jobs) + " wait"


def _matrix_all(folder: str, gpus: str, w1_per_gpu: int = 3, w2_per_pair: int = 6, only: str = "") -> str:
    """Both matrices at once: w1_per_gpu W=1 shards a GPU, w2_per_pair W=2 shards a pair of GPUs
    (a cell is mostly start-up and Inductor on the host: 64 cores keep 24 shards busy), merged;
    only: the cells whose name contains it (gpu_matrix.py --only)."""
    n = int(gpus)
    gm = os.path.join(HERE, "gpu_matrix.py") + (f" --only {shlex.quote(only)}" if only else "")
    jobs, outs = [], {1: [], 2: []}
    for i in range(w1_per_gpu * n):
        out = os.path.join(folder, f"w1-shard{i}.json")
        outs[1].append(out)
        jobs.append(f"CUDA_VISIBLE_DEVICES={i % n} {sys.executable} {gm} --workers 1 --shard {i}/{w1_per_gpu * n} "
                    f"--out {out} > {folder}/w1-shard{i}.log 2>&1")
    pairs = [(a, a + 1) for a in range(0, n - 1, 2)]
    for i in range(w2_per_pair * len(pairs)):  # W=2 cells are the slower, and more
        a, b = pairs[i % len(pairs)]
        out = os.path.join(folder, f"w2-shard{i}.json")
        outs[2].append(out)
        jobs.append(f"CUDA_VISIBLE_DEVICES={a},{b} {sys.executable} {gm} --workers 2 --shard {i}/{w2_per_pair * len(pairs)} "
                    f"--out {out} > {folder}/w2-shard{i}.log 2>&1")
    merge = [f"{sys.executable} {gm} --merge {' '.join(outs[w])} --out {folder}/gpu-matrix-w{w}.json | tail -3"
             for w in (1, 2) if outs[w]]
    return " & ".join(jobs) + " & wait; " + "; ".join(merge)


def _sweeps(folder: str) -> str:
    """The seed's alexnet-sweep grid on every GPU, then the default GPU sweep (8 trials), each
    with its log's tail (parts sweeps56, s27x)."""
    data = os.path.join(ROOT_DIR, "data", "fashion-mnist")
    seed = _py("-m", "shmlearn", "experiment", "run", "alexnet-sweep", "--device", "cuda",
               "--out", os.path.join(folder, "alexnet-sweep"))
    default = _py("-m", "shmlearn", "sweep", "--device", "cuda", "--model", "alexnet-small", "--dataset",
                  "fashion-mnist", "--data-dir", data, "--workers", "1,2", "--batch-size", "64,256", "--lr",
                  "0.05,0.1", "--samples", "60000", "--out", os.path.join(folder, "default"))
    return (f"{shlex.join(seed)} > {folder}/alexnet-sweep.log 2>&1; tail -n 40 {folder}/alexnet-sweep.log; "
            f"{shlex.join(default)} > {folder}/default.log 2>&1; tail -n 12 {folder}/default.log")


def _s27(folder: str, gpus: int) -> str:
    """part s27: see its comment in part_commands. On one GPU: the tests (both ranks on it over
    Gloo) beside 6 matrix cells whose eager steps call an optimizer's step() (Adam-type, async-ps),
    then the profile, then the sweeps at 1 worker."""
    data = os.path.join(ROOT_DIR, "data", "fashion-mnist")
    spy = os.path.join(ROOT_DIR, "data", "tools", "py-spy")
    prog = shlex.join(_py("-m", "shmlearn"))
    tests = (f"CUDA_VISIBLE_DEVICES=0{',1' if gpus > 1 else ''} {sys.executable} -m pytest -q -p no:cacheprovider "
             f"-rfE tests/launch/test_lean_gpu.py > {folder}/lean-tests.log 2>&1; tail -n 3 {folder}/lean-tests.log")
    profiled = (f"CUDA_VISIBLE_DEVICES={2 if gpus > 2 else 0} {spy} record --subprocesses --idle -r 200 -f raw "
                f"-o {folder}/spy-w1.txt -- {prog} sweep --device cuda --model alexnet-small --dataset fashion-mnist "
                f"--data-dir {data} --workers 1 --batch-size 64,128 --lr 0.1,0.2,0.3,0.4,0.5,0.6 --samples 30720 "
                f"--eval-points 5 --no-report --out {folder}/spy-sweep > {folder}/spy.log 2>&1; "
                f"gzip -f {folder}/spy-w1.txt")
    seed = (f"{prog} experiment run alexnet-sweep --device cuda --out {folder}/alexnet-sweep "
            f"> {folder}/alexnet-sweep.log 2>&1; grep 'sweep: ran' {folder}/alexnet-sweep.log; "
            f"{prog} experiment run alexnet-sweep --device cuda --axis cudnn_benchmark=off "
            f"--out {folder}/alexnet-sweep-heur > {folder}/alexnet-sweep-heur.log 2>&1; "
            f"grep 'sweep: ran' {folder}/alexnet-sweep-heur.log")
    default = (f"sweep --device cuda --model alexnet-small --dataset fashion-mnist --data-dir {data} "
               f"--workers {'1,2' if gpus > 1 else '1'} --batch-size 64,256 --lr 0.05,0.1 --samples 60000")
    pyc = f"env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX={folder}/pyc"
    defaults = "; ".join(f"{env} {prog} {default} --out {folder}/default-{name} > {folder}/default-{name}.log 2>&1; "
                         f"grep 'sweep: ran' {folder}/default-{name}.log"
                         for name, env in (("shipped", ""), ("pyc-fill", pyc), ("pyc", pyc)))
    if gpus > 2:
        return f"({tests}) & ({profiled}) & wait; {seed}; {defaults}"
    cells = _matrix_all(os.path.join(folder, "matrix"), "1", w1_per_gpu=2, w2_per_pair=0, only=",".join((
        "alexnet-small/bf16/allreduce/W1/adamw", "resnet18/bf16/allreduce/W1/adamw", "fashion-net/fp32/ps/W1/adamw",
        "alexnet-small/bf16/allreduce/W1/nadam", "alexnet-small/fp32/async-ps/W1/default",
        "fashion-net/fp32/async-ps/W1/default")))
    return f"mkdir -p {folder}/matrix; ({tests}) & ({cells}) & wait; {profiled}; {seed}; {defaults}"


def _s27b(folder: str) -> str:
    """part s27b (GPU 0): what a one-GPU run's process group costs (a world-1 NCCL group against
    Gloo's: the default `train` both ways, three times each after a cold first, and
    init_process_group alone in fresh processes)."""
    prog = shlex.join(_py("-m", "shmlearn"))
    timed = ("import json, subprocess, sys, time; t = time.time(); "
             "r = subprocess.run(sys.argv[3:], capture_output=True, text=True); wall = time.time() - t; "
             "s = json.load(open(sys.argv[2] + '/summary.json')) if r.returncode == 0 else {}; "
             "print(json.dumps(dict(case=sys.argv[1], rc=r.returncode, wall_s=wall, "
             "setup_s=s.get('setup_time_s'), train_s=s.get('wall_time_s'), eval_s=s.get('eval_time_s'), "
             "train_start_unix=s.get('train_start_unix'), t0_unix=t, test_accuracy=s.get('test_accuracy'), "
             "err=r.stderr[-400:])), flush=True)")
    runs = [f"{sys.executable} -c 'import time; t = time.time(); import torch; torch.zeros(1, device=\"cuda\"); "
            f"print(\"floor\", time.time() - t)' >> {folder}/floor.txt"] * 2
    for i, backend in enumerate(("nccl", "nccl", "gloo", "nccl", "gloo", "nccl", "gloo")):
        out = os.path.join(folder, f"train-{i}-{backend}")
        extra = [] if backend == "nccl" else ["--backend", "gloo"]
        cmd = shlex.join([sys.executable, "-m", "shmlearn", "train", "--device", "cuda", "--model", "alexnet-small",
                          "--no-progress", "--out", out, *extra])
        runs.append(f"{sys.executable} -c {shlex.quote(timed)} {'cold' if i == 0 else backend} {out} {cmd} "
                    f">> {folder}/train.jsonl")
    pg = ("import os, sys, time, datetime; t0 = time.time(); import torch, torch.distributed as dist; "
          "t1 = time.time(); torch.cuda.set_device(0); torch.zeros(1, device='cuda'); t2 = time.time(); "
          "store = dist.TCPStore('127.0.0.1', 0, 1, True); b = sys.argv[1]; "
          "kw = dict(device_id=torch.device('cuda', 0)) if b == 'nccl' else {}; "
          "dist.init_process_group(b, store=store, rank=0, world_size=1, **kw); t3 = time.time(); "
          "x = torch.ones(4, device='cuda'); dist.all_reduce(x); torch.cuda.synchronize(); t4 = time.time(); "
          "print(b, 'import', round(t1 - t0, 3), 'cuda', round(t2 - t1, 3), 'init_pg', round(t3 - t2, 3), "
          "'first_allreduce', round(t4 - t3, 3), flush=True); os._exit(0)")
    runs += [f"{sys.executable} -c {shlex.quote(pg)} {b} >> {folder}/pg.txt 2>&1" for b in ("nccl", "gloo") * 3]
    return ("export CUDA_VISIBLE_DEVICES=0; " + "; ".join(runs)
            + f"; cat {folder}/floor.txt {folder}/pg.txt; cut -c1-300 {folder}/train.jsonl")


def _s27c(folder: str) -> str:
    """part s27c (every GPU of the lease): the seed's grid with the lean pool, then with the
    forkserver importing torch._dynamo as before (--axis compile=off: the program cannot tell that
    it compiles nothing), then the default sweep (lean)."""
    data = os.path.join(ROOT_DIR, "data", "fashion-mnist")
    prog = shlex.join(_py("-m", "shmlearn"))
    grids = "; ".join(f"{prog} experiment run alexnet-sweep --device cuda {extra} --out {folder}/alexnet-sweep-{name} "
                      f"> {folder}/alexnet-sweep-{name}.log 2>&1; grep 'sweep: ran' {folder}/alexnet-sweep-{name}.log"
                      for name, extra in (("lean", ""), ("full", "--axis compile=off")))
    return (grids + f"; {prog} sweep --device cuda --model alexnet-small --dataset fashion-mnist --data-dir {data} "
            f"--workers 1,2 --batch-size 64,256 --lr 0.05,0.1 --samples 60000 --out {folder}/default "
            f"> {folder}/default.log 2>&1; grep 'sweep: ran' {folder}/default.log")


def _s27d(folder: str) -> str:
    """part s27d (every GPU of the lease): lean against full pools, interleaved three times each,
    on a 24-trial part of the seed's grid (lr 0.1, 0.2: every batch size and worker count); then
    the matrix cells of s27 (one GPU, two shards), whose 1-worker pool groups are now lazy."""
    prog = shlex.join(_py("-m", "shmlearn"))
    runs = [f"{prog} experiment run alexnet-sweep --device cuda --axis lr=0.1,0.2 {extra} "
            f"--out {folder}/grid-{i}-{name} > {folder}/grid-{i}-{name}.log 2>&1; "
            f"echo {i}-{name}: $(grep 'sweep: ran' {folder}/grid-{i}-{name}.log)"
            for i in range(3) for name, extra in (("lean", ""), ("full", "--axis compile=off"))]
    cells = _matrix_all(os.path.join(folder, "matrix"), "1", w1_per_gpu=2, w2_per_pair=0, only=",".join((
        "alexnet-small/bf16/allreduce/W1/adamw", "resnet18/bf16/allreduce/W1/adamw", "fashion-net/fp32/ps/W1/adamw",
        "alexnet-small/bf16/allreduce/W1/nadam", "alexnet-small/fp32/async-ps/W1/default",
        "fashion-net/fp32/async-ps/W1/default", "lenet/fp32/weight-avg/W1/default", "mlp/fp32/ddp/W1/default")))
    return "; ".join(runs) + f"; mkdir -p {folder}/matrix; {cells}"


def _fashion94_starts(folder: str) -> str:
    """recipes/fashion-94-2gpu.yaml from outside: once with empty caches, then twice warm; each
    run's wall seconds and its summary's setup, compile and training seconds, in folder/fashion94.jsonl."""
    data = os.path.join(ROOT_DIR, "data", "fashion-mnist")
    recipe = os.path.join(ROOT_DIR, "recipes", "fashion-94-2gpu.yaml")
    cache = os.path.join(folder, "caches")
    env = f"SHMLEARN_CACHE_DIR={cache}/s TRITON_CACHE_DIR={cache}/t TORCHINDUCTOR_CACHE_DIR={cache}/i"
    timed = ("import json, subprocess, sys, time; t = time.time(); "
             "r = subprocess.run(sys.argv[3:]); wall = time.time() - t; "
             "s = json.load(open(sys.argv[2] + '/summary.json')); "
             "print(json.dumps(dict(case=sys.argv[1], rc=r.returncode, wall_s=wall, "
             "setup_s=s.get('setup_time_s'), compile_s=s.get('compile_s'), train_s=s.get('wall_time_s'), "
             "eval_s=s.get('eval_time_s'), test_accuracy=s.get('test_accuracy'))), flush=True)")
    runs = []
    for case in ("cold", "warm1", "warm2"):
        out = os.path.join(folder, f"fashion94-{case}")
        runs.append(f"env {env} {sys.executable} -c {shlex.quote(timed)} {case} {out} {sys.executable} -m shmlearn "
                    f"train --config {recipe} --data-dir {data} --device cuda --no-progress --out {out} "
                    f">> {folder}/fashion94.jsonl 2>> {folder}/fashion94.log")
    return f"rm -rf {cache}; " + "; ".join(runs) + f"; cat {folder}/fashion94.jsonl"


F94_CASES = ("cold", "warm1", "warm2", "pyc-fill", "pyc-warm1", "pyc-warm2", "pyc-early0", "pyc-spy")


def _fashion94_pyc(folder: str, cases=F94_CASES) -> str:
    """Issue 52's fashion-94 warm start, both ways a machine may import Python: as the device
    image ships it (PYTHONDONTWRITEBYTECODE=1: every process compiles torch's sources again), and
    with Python's bytecode cache (PYTHONPYCACHEPREFIX, as a normal install keeps it beside the
    sources). Cold once (empty caches), warm twice as shipped; then with the bytecode cache: one
    run to fill it, warm twice, once with SHMLEARN_EARLY=0 (train/early.py off), and once under
    py-spy (data/tools/py-spy, where carried: every process, 100 samples/s, speedscope)."""
    data = os.path.join(ROOT_DIR, "data", "fashion-mnist")
    recipe = os.path.join(ROOT_DIR, "recipes", "fashion-94-2gpu.yaml")
    cache = os.path.join(folder, "caches")
    env = f"SHMLEARN_CACHE_DIR={cache}/s TRITON_CACHE_DIR={cache}/t TORCHINDUCTOR_CACHE_DIR={cache}/i"
    pyc = f"-u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX={cache}/pyc"
    timed = ("import json, subprocess, sys, time; t = time.time(); "
             "r = subprocess.run(sys.argv[3:]); wall = time.time() - t; "
             "s = json.load(open(sys.argv[2] + '/summary.json')); "
             "print(json.dumps(dict(case=sys.argv[1], rc=r.returncode, wall_s=wall, "
             "setup_s=s.get('setup_time_s'), compile_s=s.get('compile_s'), train_s=s.get('wall_time_s'), "
             "eval_s=s.get('eval_time_s'), train_start_unix=s.get('train_start_unix'), t0_unix=t, "
             "test_accuracy=s.get('test_accuracy'))), flush=True)")
    spy = os.path.join(ROOT_DIR, "data", "tools", "py-spy")
    runs = []
    extras = {"pyc-early0": pyc + " SHMLEARN_EARLY=0"}
    for case in cases:
        extra = extras.get(case, pyc if case.startswith("pyc") else "")
        out = os.path.join(folder, f"f94-{case}")
        cmd = [sys.executable, "-m", "shmlearn", "train", "--config", recipe, "--data-dir", data, "--device", "cuda",
               "--no-progress", "--out", out]
        if case == "pyc-spy":
            cmd = [spy, "record", "--subprocesses", "--idle", "-r", "100", "-f", "speedscope", "-o",
                   os.path.join(folder, "f94-spy.speedscope.json"), "--"] + cmd
        runs.append(f"env {extra} {env} {sys.executable} -c {shlex.quote(timed)} {case} {out} {shlex.join(cmd)} "
                    f">> {folder}/fashion94.jsonl 2>> {folder}/fashion94.log")
    return f"rm -rf {cache}; " + "; ".join(runs) + f"; cat {folder}/fashion94.jsonl"


def _uw(folder: str, lanes, variants: str = "off,default") -> str:
    """Parts uw-12 and uw-4 (uw-c12, uw-c4: shmlearn compiled only, beside both baselines):
    benchmarks/user_workloads.py, the ViT then the LM, in each lane (CUDA_VISIBLE_DEVICES, GPU
    count), the lanes side by side."""
    uw = os.path.join(HERE, "user_workloads.py")
    jobs = []
    for devices, n in lanes:
        runs = [f"CUDA_VISIBLE_DEVICES={devices} {sys.executable} {uw} --gpus {n} --workloads {w} --repeats 3 "
                f"--steps 200 --warmup 50 --variants {variants} --out {folder}/uw-{w}-{n}gpu.json "
                f"> {folder}/uw-{w}-{n}gpu.log 2>&1"
                for w in ("vit", "lm")]
        jobs.append("(" + "; ".join(runs) + ")")
    return " & ".join(jobs) + " & wait; tail -n 25 " + " ".join(
        f"{folder}/uw-{w}-{n}gpu.log" for _, n in lanes for w in ("vit", "lm"))


def _duo(folder: str) -> str:
    """Part `duo`: two 2-GPU jobs side by side (GPUs 0,1 and 2,3), each a chain of commands."""
    sh = ["-m", "shmlearn"]
    fr = os.path.join(HERE, "fashion_recipe.py")

    def recipe(tag, extra):
        return shlex.join(_py(fr, "run", "--device", "cuda", "--seeds", "5", "--recipes", "fashion-94",
                              "--runs", os.path.join(folder, tag), "--train-args", extra,
                              "--out", os.path.join(folder, f"fashion-94-{tag}.json")))
    left = [shlex.join(_py(*sh, "experiment", "run", "alexnet-sweep", "--device", "cuda",
                           "--out", os.path.join(folder, "alexnet-sweep-2gpu"))),
            "export CUDA_VISIBLE_DEVICES=0", recipe("x1", "")]
    right = [recipe("x2-b256", "--workers 2 --batch-size 256"),
             recipe("x2-b512", "--workers 2 --batch-size 512 --lr 0.4")]
    return (f"(export CUDA_VISIBLE_DEVICES=0,1; {'; '.join(left)}) > {folder}/left.log 2>&1 & "
            f"(export CUDA_VISIBLE_DEVICES=2,3; {'; '.join(right)}) > {folder}/right.log 2>&1 & wait; "
            f"tail -n 5 {folder}/left.log {folder}/right.log")


def _duo2(folder: str) -> str:
    """Part `duo2`: fashion-94 at 2 workers in four settings (two at a time, GPUs 0,1 and 2,3),
    and cpu-vs-gpu with its 2-GPU rows on GPUs 2,3 after the second."""
    fr = os.path.join(HERE, "fashion_recipe.py")
    data = os.path.join(ROOT_DIR, "data", "fashion-mnist")

    def recipe(tag, extra):
        return shlex.join(_py(fr, "run", "--device", "cuda", "--seeds", "5", "--recipes", "fashion-94",
                              "--data-dir", data, "--runs", os.path.join(folder, tag), "--train-args", extra,
                              "--out", os.path.join(folder, f"fashion-94-{tag}.json")))
    left = [recipe("x2-b512-lr04-e30", "--workers 2 --batch-size 512 --lr 0.4 --epochs 30"),
            recipe("x2-b384-lr03-e28", "--workers 2 --batch-size 384 --lr 0.3 --epochs 28"),
            recipe("x2-b256-e25", "--workers 2 --batch-size 256")]
    right = [recipe("x2-b512-lr03-e30", "--workers 2 --batch-size 512 --lr 0.3 --epochs 30"),
             shlex.join(_py("-m", "shmlearn", "experiment", "run", "cpu-vs-gpu", "--device", "cuda",
                            "--out", os.path.join(folder, "cpu-vs-gpu")))]
    return (f"(export CUDA_VISIBLE_DEVICES=0,1; {'; '.join(left)}) > {folder}/left.log 2>&1 & "
            f"(export CUDA_VISIBLE_DEVICES=2,3; {'; '.join(right)}) > {folder}/right.log 2>&1 & wait; "
            f"tail -n 5 {folder}/left.log {folder}/right.log")


def _cli_defaults(folder: str) -> str:
    """Issue 36, acceptance 1: `shmlearn train --device cuda --model M --dataset D` with default
    flags for every built-in model (fp32, and bf16), each a fresh process as a user starts it, four
    at a time alternating GPUs; then a default `sweep --device cuda` over alexnet-small on
    Fashion-MNIST. Each run's exit code and last lines go to folder/cli.tsv and the log."""
    sys.path.insert(0, HERE)
    from gpu_matrix import NATURAL
    data = os.path.join(ROOT_DIR, "data", "fashion-mnist")
    jobs = []
    for k, (m, prec) in enumerate((m, p) for m in NATURAL for p in ("fp32", "bf16")):
        d = NATURAL[m]
        cmd = shlex.join(_py("-m", "shmlearn", "train", "--device", "cuda", "--model", m, "--dataset", d,
                             *(["--data-dir", data] if d == "fashion-mnist" else []),
                             *(["--precision", prec] if prec != "fp32" else []), "--no-progress",
                             "--out", os.path.join(folder, f"{m}-{prec}")))
        log = os.path.join(folder, f"{m}-{prec}.log")
        jobs.append(f"(CUDA_VISIBLE_DEVICES={k % 2} {cmd} > {log} 2>&1; echo \"{m}\t{prec}\t$?\" >> {folder}/cli.tsv)")
    waves = [" & ".join(jobs[i:i + 4]) + " & wait" for i in range(0, len(jobs), 4)]
    sweep = shlex.join(_py("-m", "shmlearn", "sweep", "--device", "cuda", "--model", "alexnet-small",
                           "--dataset", "fashion-mnist", "--data-dir", data, "--workers", "1,2",
                           "--batch-size", "64,256", "--lr", "0.05,0.1", "--samples", "60000",
                           "--out", os.path.join(folder, "sweep")))
    return "; ".join(waves + [f"cat {folder}/cli.tsv", f"tail -n 3 {folder}/*.log", sweep,
                              f"echo sweep rc=$?; wc -l {folder}/sweep/results.jsonl"])


def part_commands(p: str, workers: str) -> dict:
    """name -> (command, time limit in s). p(name) is the part's output folder."""
    sh = "-m", "shmlearn"

    def recipe(part: str, out: str, limit: int, *extra: str) -> tuple:
        """benchmarks/fashion_recipe.py on the GPU, 5 seeds, its runs and JSON in the part's folder."""
        return (_py(os.path.join(HERE, "fashion_recipe.py"), "run", "--device", "cuda", "--seeds", "5", *extra,
                    "--data-dir", os.path.join(ROOT_DIR, "data", "fashion-mnist"),
                    "--runs", os.path.join(p(part), "runs"), "--out", os.path.join(p(part), out)), limit)
    big = workers.split(",")[-1]
    return {
        "env": (["bash", "-c", "nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch; print(torch.__version__, "
                               "torch.version.cuda, torch.cuda.device_count(), torch.cuda.nccl.version())'; nproc; "
                               "free -g"], 30),
        "tput-alexnet": (_py(*sh, "bench", "throughput", "--device", "cuda", "--model", "alexnet-small",
                             "--workers", workers, "--batch-sizes", "128,1024",
                             "--strategies", "allreduce,ps,weight-avg", "--baselines", "plain,ddp,local",
                             "--avg-period", "8", "--precision", "bf16", "--channels-last", "--repeats", "5",
                             "--seconds", "0.2", "--sync-models", "resnet34",
                             "--out", os.path.join(p("tput-alexnet"), "throughput.json")), 300),
        "tput-resnet34": (_py(*sh, "bench", "throughput", "--device", "cuda", "--model", "resnet34",
                              "--input", "3x32x32", "--workers", workers, "--batch-sizes", "128",
                              "--strategies", "allreduce,ps,weight-avg", "--baselines", "plain,ddp,local",
                              "--avg-period", "8", "--precision", "bf16", "--channels-last", "--repeats", "5",
                              "--seconds", "0.3", "--out", os.path.join(p("tput-resnet34"), "throughput.json")), 300),
        # Issue 18, split in two so that each fits one 10-minute device call: Inductor compiles
        # (cold cache) and max-autotune's template benchmarking take most of the time, not the timing.
        "tput-compile-a": (_gpu_bench(p("tput-compile-a"), [
            ("alexnet-small", "3x32x32", 128, MAX4, "allreduce,allreduce:compile,allreduce:compile-max"),
            ("resnet18", "3x32x32", 128, MAX4, "allreduce,allreduce:compile"),
            ("alexnet-small", "3x32x32", 1024, MAX4, "allreduce,allreduce:compile,allreduce:compile-max"),
            ("resnet18", "3x32x32", 1024, MAX4, "allreduce,allreduce:compile")]), 540),
        "tput-compile-b": (_gpu_bench(p("tput-compile-b"), [
            ("resnet34", "3x32x32", 128, MAX4, "allreduce,allreduce:compile"),
            ("resnet34", "3x32x32", 1024, MAX4, "allreduce,allreduce:compile")]), 540),
        "validation": (_py(os.path.join(HERE, "comm_validation.py"), "--device", "cuda", "--tag", f"h200x{big}",
                           "--workers", workers.split(",", 1)[1] if "," in workers else workers,
                           "--comm-workers", workers.split(",", 1)[1] if "," in workers else workers,
                           "--models", "alexnet-small,resnet34", "--strategies", "allreduce,ps",
                           "--ps-sim-workers", f"1-{big}", "--max-processes", big,
                           "--results", p("validation"), "--runs", "/tmp/validation-runs"), 360),
        "train-check": (["bash", "-c", f"for w in {workers.split(',', 1)[-1].replace(',', ' ')}; do for s in allreduce ps; do "
                                       f"TIMEFORMAT=\"W=$w $s: %R s wall\"; time timeout 60 {' '.join(_py(*sh))} train "
                                       "--device cuda --dataset synthetic --model alexnet-small --workers $w --strategy $s "
                                       "--samples 100000 --no-progress --out /tmp/train-check-$w-$s || echo \"W=$w $s FAILED\"; "
                                       "done; done"], 200),
        "comm": (_py(os.path.join(HERE, "comm_validation.py"), "--device", "cuda", "--tag", f"h200x{big}",
                     "--skip", "train", "--comm-workers", workers.split(",", 1)[1] if "," in workers else workers,
                     "--ps-sim-workers", f"1-{big}", "--results", p("comm")), 200),
        "sweep": (_py(*sh, "experiment", "run", "alexnet-sweep", "--device", "cuda",
                      "--axis", f"workers={','.join(reversed(workers.split(',')))}",
                      "--axis", "lr=0.2,0.5,0.8", "--out", os.path.join(p("sweep"), "alexnet-sweep")), 420),
        # Issue 14: the seed's whole alexnet-sweep grid on one GPU (what the alexnet-sweep experiment
        # fixes, as `shmlearn sweep` flags), without and with exact pruning; then their timings.
        "grid": (_py(*sh, "sweep", *SEED_GRID, "--out", os.path.join(p("grid"), "sweep")), 540),
        "grid-prune": (_py(*sh, "sweep", *SEED_GRID, "--prune", "--out", os.path.join(p("grid-prune"), "sweep")), 480),
        # The same grid without cuDNN autotuning: what autotuning costs a sweep (1 s per new batch
        # shape) and what it buys its training time, in one session.
        "grid-heuristic": (_py(*sh, "sweep", *SEED_GRID, "--cudnn-benchmark", "off",
                               "--out", os.path.join(p("grid-heuristic"), "sweep")), 540),
        # The same two with --deterministic: GPU numerics otherwise differ from run to run (cuDNN's
        # autotuned algorithms), and at the edge of stability a trial diverges in one run and not in
        # the other, so only deterministic runs can show that --prune keeps the full grid's winners.
        "grid-det": (_py(*sh, "sweep", *SEED_GRID, "--deterministic", "--out", os.path.join(p("grid-det"), "sweep")), 540),
        "grid-det-prune": (_py(*sh, "sweep", *SEED_GRID, "--deterministic", "--prune",
                               "--out", os.path.join(p("grid-det-prune"), "sweep")), 480),
        "analyze": (_py(os.path.join(HERE, "sweep_overhead.py"), "analyze", os.path.join(p("grid"), "sweep"),
                        os.path.join(p("grid-prune"), "sweep"), "--tag", "h100-grid",
                        "--out", os.path.join(p("analyze"), "sweep_overhead.json")), 60),
        # Issue 52, "Measure first": time to the first line and step, wall and phases of `train`
        # (alexnet-small), a digits trial, its 8-trial sweep and the Python API, against import
        # torch + a CUDA context; cold (empty shmlearn, Triton and Inductor caches) then warm.
        "startup": (_py(os.path.join(HERE, "start.py"), "--device", "cuda", "--repeats", "2",
                      "--out", os.path.join(p("startup"), "start-gpu.json")), 570),
        "startup-warm": (_py(os.path.join(HERE, "start.py"), "--device", "cuda", "--repeats", "5", "--temps", "warm",
                           "--out", os.path.join(p("startup-warm"), "start-gpu-warm.json")), 480),
        # Issue 16: torchvision's ResNet-18 passed in as the user's model vs the built-in resnet18.
        "own-model": (_py(os.path.join(HERE, "own_model.py"), "--device", "cuda", "--runs", "3",
                          "--out", os.path.join(p("own-model"), "own_model.json")), 300),
        "cnn": (_py(*sh, "experiment", "run", "cnn", "--device", "cuda", "--out", os.path.join(p("cnn"), "cnn")), 360),
        # async-ps on one GPU: the server and its workers share it through --backend gloo.
        "async-smoke": (["bash", "-c", "set -x; for a in 'async-ps --staleness 2 --workers 3' 'async-ps --staleness 0 "
                                       "--workers 2' 'ps --ps-dedicated --workers 2' 'allreduce --workers 2'; do "
                         f"python -m shmlearn train --device cuda --backend gloo --no-progress --dataset fashion-mnist --data-dir {os.path.join(ROOT_DIR, 'data', 'fashion-mnist')} --samples 60000 --strategy $a "
                         f"--out {p('async-smoke')}/$(echo $a | tr -d ' -'); done"], 240),
        # --compile inside the captured step: it must still be cuda-graph mode, and say what compile cost.
        "compile-smoke": (["bash", "-c", "set -x; for c in off default auto; do "
                           f"python -m shmlearn train --device cuda --workers 1 --model alexnet-small --dataset fashion-mnist "
                           f"--data-dir {os.path.join(ROOT_DIR, 'data', 'fashion-mnist')} --samples 120000 --batch-size 512 "
                           f"--precision bf16 --channels-last --no-progress --compile $c --out {p('compile-smoke')}/$c && "
                           f"python -c \"import json; s=json.load(open('{p('compile-smoke')}/$c/summary.json')); "
                           f"print({{k: s[k] for k in ('compile', 'compile_s', 'step_mode', 'samples_per_s', 'test_accuracy', 'step_note')}})\"; "
                           "done"], 300),
        "straggler": (_py(os.path.join(HERE, "straggler.py"), "--device", "cuda", "--runs", "2", "--steps", "200",
                          "--staleness", "2",
                          "--data-dir", os.path.join(ROOT_DIR, "data", "fashion-mnist"),
                          "--out", os.path.join(p("straggler"), "h100.json")), 540),
        "noise": (_py(os.path.join(HERE, "noise_scale_overhead.py"), "--device", "cuda",
                      "--out", os.path.join(p("noise"), "noise-scale-overhead-h100.json")), 420),
        # Issue 18: the Fashion-MNIST recipes as a user runs them (`shmlearn train --config
        # recipes/fashion-9X.yaml`, one process per seed 0-4), against their targets; 10 runs of
        # <= 5 s training plus each process's start-up.
        "fashion-recipe": recipe("fashion-recipe", "fashion-recipe-h100.json", 480),
        # The recipes with --compile (a faster step buys epochs within the time budget).
        "fashion-93-compile": recipe("fashion-93-compile", "fashion-93-compile-e6-h100.json", 300,
                                     "--recipes", "fashion-93", "--train-args", "--compile default --epochs 6"),
        "fashion-94-compile": recipe("fashion-94-compile", "fashion-94-compile-e20-h100.json", 360,
                                     "--recipes", "fashion-94", "--train-args", "--compile default --epochs 20"),
        "fashion-94-compile-e22": recipe("fashion-94-compile-e22", "fashion-94-compile-e22-h100.json", 360,
                                         "--recipes", "fashion-94", "--train-args", "--compile default --epochs 22"),
        # --image-conv im2col takes fashion-net's 1-channel first conv off cuDNN: one more epoch in the budget?
        "fashion-94-im2col-e23": recipe("fashion-94-im2col-e23", "fashion-94-compile-im2col-e23-h100.json", 300,
                                        "--recipes", "fashion-94", "--train-args",
                                        "--compile default --image-conv im2col --epochs 23"),
        "tput-compile-1024": (_gpu_bench(p("tput-compile-1024"), [
            (m, "3x32x32", 1024, "plain,graph,compile", "allreduce,allreduce:compile")
            for m in ("alexnet-small", "resnet18", "resnet34")]), 480),
        # Issue 18, acceptance 3: each operator of the step against the GPU's measured limits
        # (eager kernels), and the compiled step's Triton kernels with Inductor's byte counts.
        "roofline": (["bash", "-c", "; ".join(
            f"{sys.executable} {os.path.join(HERE, 'throughput_profile.py')} --model {m} --batch-sizes {b} "
            f"--precision bf16 --channels-last --variants off,compile --out {p('roofline')}/profile-{m}.json"
            for m, b in (("alexnet-small", "128,1024"), ("resnet18", "128")))], 420),
        # Issue 18: the same with the image's conv on shmlearn's Triton kernels (--image-conv triton).
        "roofline-triton": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "alexnet-small",
                                "--batch-sizes", "128,1024", "--precision", "bf16", "--channels-last",
                                "--variants", "triton-conv,compile+triton-conv",
                                "--out", os.path.join(p("roofline-triton"), "profile-alexnet-small.json")), 300),
        # Issue 18: the fashion-94 recipe's network at its batch: where its 1.8 ms step goes.
        "roofline-fashion": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "fashion-net",
                                 "--input", "1x28x28", "--batch-sizes", "512", "--precision", "bf16",
                                 "--channels-last", "--variants", "off,compile,compile+im2col",
                                 "--out", os.path.join(p("roofline-fashion"), "profile-fashion-net.json")), 300),
        # Issue 18: the candidate kernels alone, against their alternatives and floors.
        "kernels": (_py(os.path.join(HERE, "kernels.py"), "--device", "cuda", "--batch-sizes", "128,1024",
                        "--out", os.path.join(p("kernels"), "kernels-h100.json")), 240),
        # Issue 18: --image-conv im2col (the image's convolution as a gather and GEMMs) against the same step
        # without it and against the baselines, same run; one JSON per (model, batch).
        "tput-im2col": (_gpu_bench(p("tput-im2col"), [
            ("alexnet-small", "3x32x32", 128, "plain,graph,compile",
             "allreduce,allreduce:im2col,allreduce:compile,allreduce:compile+im2col"),
            ("alexnet-small", "3x32x32", 1024, "plain,graph,compile",
             "allreduce,allreduce:im2col,allreduce:compile,allreduce:compile+im2col"),
            ("resnet18", "3x32x32", 128, "graph,compile", "allreduce:compile,allreduce:compile+im2col"),
            ("resnet18", "3x32x32", 1024, "graph,compile", "allreduce:compile,allreduce:compile+im2col")]), 480),
        # Issue 18: --image-conv triton (shmlearn's implicit-GEMM kernels for the image's conv)
        # against cudnn and im2col in the same run, with and without --compile.
        "tput-triton-conv": (_gpu_bench(p("tput-triton-conv"), [
            ("alexnet-small", "3x32x32", 1024, "graph,compile",
             "allreduce,allreduce:triton-conv,allreduce:compile,allreduce:compile+im2col,allreduce:compile+triton-conv"),
            ("alexnet-small", "3x32x32", 128, "graph,compile", "allreduce:compile,allreduce:compile+triton-conv"),
            ("resnet18", "3x32x32", 128, "graph,compile", "allreduce:compile,allreduce:compile+triton-conv")]), 480),
        "fashion-94-triton-e23": recipe("fashion-94-triton-e23", "fashion-94-compile-triton-e23-h100.json", 300,
                                        "--recipes", "fashion-94", "--train-args",
                                        "--compile default --image-conv triton --epochs 23"),
        # Issue 18: the step with this session's defaults under --compile (image conv as im2col,
        # max-pools as reductions, gradients taken whole) against each change undone and against
        # the baselines, same run; one JSON per (model, batch).
        "tput-step-a": (_gpu_bench(p("tput-step-a"), [
            ("alexnet-small", "3x32x32", 128, MAX4, STEP_VARIANTS),
            ("alexnet-small", "3x32x32", 1024, "plain,graph,compile", STEP_VARIANTS),
            ("fashion-net", "1x28x28", 512, "graph,compile",
             "allreduce:compile,allreduce:compile+aten-pool,allreduce:compile+cudnn-conv+aten-pool+accumulate")]), 540),
        "tput-step-b": (_gpu_bench(p("tput-step-b"), [
            (m, "3x32x32", b, "plain,graph,compile", "allreduce,allreduce:compile,allreduce:compile+accumulate")
            for m, b in (("resnet18", 128), ("resnet34", 128), ("resnet18", 1024), ("resnet34", 1024))]), 560),
        # Which max-pools pay as reductions on fashion-net (after the whole-reduce run was 14% slower).
        "tput-pool-fashion": (_gpu_bench(p("tput-pool-fashion"), [
            ("fashion-net", "1x28x28", 512, "graph",
             "allreduce:compile+aten-pool,allreduce:compile+global-pool,allreduce:compile+reduce-pool")]), 240),
        "fashion-93-e7": recipe("fashion-93-e7", "fashion-93-e7-h100.json", 240,
                                "--recipes", "fashion-93", "--train-args", "--epochs 7"),
        "fashion-94-e24": recipe("fashion-94-e24", "fashion-94-e24-h100.json", 300,
                                 "--recipes", "fashion-94", "--train-args", "--epochs 24"),
        "fashion-94-e25": recipe("fashion-94-e25", "fashion-94-e25-h100.json", 300,
                                 "--recipes", "fashion-94", "--train-args", "--epochs 25"),
        "fashion-94-e26": recipe("fashion-94-e26", "fashion-94-e26-h100.json", 300,
                                 "--recipes", "fashion-94", "--train-args", "--epochs 26"),
        # Issue 18, fourth round: alexnet-small's conv + ReLU + max-pool blocks fused (--conv-pool):
        # each block alone against aten and Inductor (also the GPU check that they agree), the
        # step against the same step unfused and the baselines, and where the new step's time goes.
        "kernels-convpool": (_py(os.path.join(HERE, "kernels.py"), "--device", "cuda", "--batch-sizes", "128,1024",
                                 "--cases", "conv-pool-1,conv-pool-2,conv-pool-3",
                                 "--out", os.path.join(p("kernels-convpool"), "kernels-conv-pool-h100.json")), 300),
        "tput-convpool": (_gpu_bench(p("tput-convpool"), [
            ("alexnet-small", "3x32x32", 128, MAX4, CONV_POOL_VARIANTS),
            ("alexnet-small", "3x32x32", 1024, "plain,graph,compile", CONV_POOL_VARIANTS)]), 540),
        "roofline-convpool": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "alexnet-small",
                                  "--batch-sizes", "128,1024", "--precision", "bf16", "--channels-last",
                                  "--variants", "off,compile",
                                  "--out", os.path.join(p("roofline-convpool"), "profile-alexnet-small.json")), 360),
        # The fused blocks in real training on the GPU (bf16): alexnet-small on Fashion-MNIST,
        # 3 epochs, fused and unfused, compiled and not; the runs' summaries side by side.
        "convpool-train": (["bash", "-c", "; ".join(
            shlex.join(_py(*sh, "train", "--model", "alexnet-small", "--dataset", "fashion-mnist", "--data-dir",
                           os.path.join(ROOT_DIR, "data", "fashion-mnist"), "--device", "cuda", "--workers", "1",
                           "--epochs", "3", "--batch-size", "128", "--lr", "0.05", "--precision", "bf16",
                           "--channels-last", "--seed", "0", "--eval-points", "1", "--no-progress",
                           "--conv-pool", cp, "--compile", comp, "--out", os.path.join(p("convpool-train"), f"{cp}-{comp}")))
            for comp in ("off", "default") for cp in ("off", "triton")) + "; " + shlex.join(_py("-c", (
                "import json,glob,sys\n"
                "for f in sorted(glob.glob(sys.argv[1] + '/*/summary.json')):\n"
                "    s = json.load(open(f)); print(f.split('/')[-2], 'acc', s.get('test_accuracy'), 'wall_time_s',"
                " s.get('wall_time_s'), 'samples_per_s', s.get('samples_per_s'), 'conv_pools', s.get('conv_pools'), 'compile', s.get('compile'),"
                " 'step_mode', s.get('step_mode'))"), p("convpool-train")))], 420),
        # Issue 18, fifth round: the update as one kernel over the flat buffers (flat_sgd.py), the
        # gradients adopted by one cat, the loss compiled with the model, the image block's weight
        # gradient summed into place; against torch's fused SGD (torch-sgd) and the baselines.
        "tput-flat": (_gpu_bench(p("tput-flat"), [
            ("alexnet-small", "3x32x32", 128, MAX4, FLAT_VARIANTS),
            ("alexnet-small", "3x32x32", 1024, "plain,graph,compile", FLAT_VARIANTS)]), 420),
        "roofline-flat": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "alexnet-small",
                              "--batch-sizes", "128,1024", "--precision", "bf16", "--channels-last",
                              "--variants", "compile",
                              "--out", os.path.join(p("roofline-flat"), "profile-alexnet-small.json")), 300),
        # Issue 18, fifth round, final: every row of acceptance 2 with this round's step (flat SGD,
        # the loss compiled with the model, --mlp-head auto) against torch's fused SGD, the unfused
        # head and the baselines, same run; the head and the image block alone; the profile.
        "tput-final-alexnet": (_gpu_bench(p("tput-final-alexnet"), [
            ("alexnet-small", "3x32x32", 128, MAX4, FINAL_VARIANTS),
            ("alexnet-small", "3x32x32", 1024, "plain,graph,compile", FINAL_VARIANTS)]), 480),
        "tput-final-resnet": (_gpu_bench(p("tput-final-resnet"), [
            (m, "3x32x32", b, "plain,graph,compile", "allreduce:compile,allreduce:compile+torch-sgd")
            for m, b in (("resnet18", 128), ("resnet34", 128), ("resnet18", 1024), ("resnet34", 1024))]), 600),
        "kernels-final": (_py(os.path.join(HERE, "kernels.py"), "--device", "cuda", "--batch-sizes", "128,1024",
                              "--cases", "mlp-head,conv-pool-1",
                              "--out", os.path.join(p("kernels-final"), "kernels-h100.json")), 240),
        "roofline-final": (["bash", "-c", "; ".join(
            f"{sys.executable} {os.path.join(HERE, 'throughput_profile.py')} --model {m} --batch-sizes {b} "
            f"--precision bf16 --channels-last --variants compile --out {p('roofline-final')}/profile-{m}.json"
            for m, b in (("alexnet-small", "128,1024"), ("resnet18", "128")))], 360),
        # Issue 18, sixth round: each convolution's two backward GEMMs on two streams
        # (--conv-overlap, default on CUDA) against the one call (serial-conv), same run, with the
        # baselines; the convolutions alone; resnet18's profile with it.
        "kernels-overlap": (_py(os.path.join(HERE, "kernels.py"), "--device", "cuda", "--batch-sizes", "128,1024",
                                "--cases", "conv-overlap-1,conv-overlap-3,conv-overlap-4,conv-pool-2,conv-pool-3",
                                "--out", os.path.join(p("kernels-overlap"), "kernels-h100.json")), 300),
        "tput-overlap-resnet": (_gpu_bench(p("tput-overlap-resnet"), [
            (m, "3x32x32", b, "plain,graph,compile", OVERLAP_VARIANTS)
            for m, b in (("resnet18", 128), ("resnet34", 128), ("resnet18", 1024), ("resnet34", 1024))]), 600),
        "tput-overlap-alexnet": (_gpu_bench(p("tput-overlap-alexnet"), [
            ("alexnet-small", "3x32x32", b, "plain,graph,compile", OVERLAP_VARIANTS) for b in (128, 1024)]), 420),
        "tput-overlap2-resnet": (_gpu_bench(p("tput-overlap2-resnet"), [
            (m, "3x32x32", b, "plain,graph,compile", OVERLAP2_VARIANTS)
            for m, b in (("resnet18", 128), ("resnet34", 128), ("resnet18", 1024), ("resnet34", 1024))]), 600),
        "tput-overlap3-resnet": (_gpu_bench(p("tput-overlap3-resnet"), [
            (m, "3x32x32", 128, "plain,graph,compile", "allreduce:compile,allreduce:compile+serial-conv")
            for m in ("resnet18", "resnet34")]), 420),
        # Max-autotune for the resnets' step: do Inductor's Triton convolution templates beat
        # cuDNN at batch 128 (acceptance 3's question of what would close the gap)?
        "tput-max-resnet": (_gpu_bench(p("tput-max-resnet"), [
            (m, "3x32x32", 128, "graph,compile", "allreduce:compile,allreduce:compile-max")
            for m in ("resnet18", "resnet34")]), 560),
        "tput-overlap2-alexnet": (_gpu_bench(p("tput-overlap2-alexnet"), [
            ("alexnet-small", "3x32x32", b, "plain,graph,compile", OVERLAP2_VARIANTS) for b in (128, 1024)]), 420),
        "roofline-overlap": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "resnet18",
                                 "--batch-sizes", "128", "--precision", "bf16", "--channels-last",
                                 "--variants", "compile",
                                 "--out", os.path.join(p("roofline-overlap"), "profile-resnet18.json")), 300),
        # Seventh round: deferred weight GEMMs. First that every variant trains to the same bits
        # (deterministic cuDNN), compiled and eager in the CUDA graph; then the step's times.
        "agree-defer": (["bash", "-c", "; ".join(
            shlex.join(_py(os.path.join(HERE, "step_agreement.py"), "--device", "cuda", "--model", m, "--batch",
                           str(b), "--steps", "30", "--variants", variants,
                           "--out", os.path.join(p("agree-defer"), f"{m}-b{b}-{kind}.json")))
            for m, b, kind, variants in AGREE_DEFER)], 560),
        "tput-defer-128": (_gpu_bench(p("tput-defer-128"), [
            (m, "3x32x32", 128, "plain,graph,compile", DEFER_VARIANTS) for m in ("resnet18", "resnet34")]), 560),
        "tput-defer-1024": (_gpu_bench(p("tput-defer-1024"), [
            (m, "3x32x32", 1024, "plain,graph,compile", DEFER_VARIANTS) for m in ("resnet18", "resnet34")]), 560),
        "agree-defer2": (_py(os.path.join(HERE, "step_agreement.py"), "--device", "cuda", "--model", "resnet18",
                             "--batch", "128", "--steps", "30", "--variants",
                             "allreduce:compile+serial-conv,allreduce:compile,allreduce:compile+2-streams,"
                             "allreduce:compile+combo",
                             "--out", os.path.join(p("agree-defer2"), "resnet18-b128-compiled.json")), 400),
        "tput-defer2-128": (_gpu_bench(p("tput-defer2-128"), [
            (m, "3x32x32", 128, "plain,graph,compile", DEFER2_VARIANTS) for m in ("resnet18", "resnet34")]), 580),
        "tput-defer2-1024": (_gpu_bench(p("tput-defer2-1024"), [
            (m, "3x32x32", 1024, "plain,graph,compile",
             "allreduce:compile,allreduce:compile+2-streams,allreduce:compile+combo,allreduce:compile+serial-conv")
            for m in ("resnet18", "resnet34")]), 560),
        "tput-cdt-128": (_gpu_bench(p("tput-cdt-128"), [
            (m, "3x32x32", 128, "graph", "allreduce:compile,allreduce:compile+cdt")
            for m in ("resnet18", "resnet34")]), 560),
        # Seventh round, the final defaults (deferred weight GEMMs, combo kernels auto) for issue
        # 18's acceptance 1 and 2, with combo off beside them at 128 (where auto turns it on).
        "tput-final-128": (_gpu_bench(p("tput-final-128"), [
            (m, "3x32x32", 128, "plain,graph,compile", "allreduce:compile,allreduce:compile+no-combo")
            for m in ("resnet18", "resnet34", "alexnet-small")]), 580),
        "tput-final-1024": (_gpu_bench(p("tput-final-1024"), [
            (m, "3x32x32", 1024, "plain,graph,compile", "allreduce:compile")
            for m in ("resnet18", "resnet34", "alexnet-small")]), 560),
        "tput-defer-alexnet": (_gpu_bench(p("tput-defer-alexnet"), [
            ("alexnet-small", "3x32x32", b, "plain,graph,compile", "allreduce:compile") for b in (128, 1024)]), 300),
        "roofline-defer": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "resnet18",
                               "--batch-sizes", "128", "--precision", "bf16", "--channels-last",
                               "--variants", "compile",
                               "--out", os.path.join(p("roofline-defer"), "profile-resnet18.json")), 300),
        # Eighth round: each convolution's SGD step inside the backward (--update-in-backward auto,
        # on here) against the update after it (late-update); bit for bit first, then the timings
        # for issue 18's acceptance 1 and 2, and the profile of resnet34 at 128 (acceptance 3).
        "tput-early-128": (_gpu_bench(p("tput-early-128"), [
            (m, "3x32x32", 128, "plain,graph,compile", "allreduce:compile,allreduce:compile+late-update")
            for m in ("resnet34", "resnet18", "alexnet-small")]), 580),
        "agree-early": (["bash", "-c", "; ".join(
            shlex.join(_py(os.path.join(HERE, "step_agreement.py"), "--device", "cuda", "--model", m, "--batch",
                           str(b), "--steps", "30", "--variants", variants,
                           "--out", os.path.join(p("agree-early"), f"{m}-b{b}-{kind}.json")))
            for m, b, kind, variants in AGREE_EARLY)], 560),
        "tput-early-1024": (_gpu_bench(p("tput-early-1024"), [
            (m, "3x32x32", 1024, "plain,graph,compile", "allreduce:compile,allreduce:compile+late-update")
            for m in ("resnet34", "resnet18", "alexnet-small")]), 560),
        "tput-knobs-128": (_gpu_bench(p("tput-knobs-128"), [
            (m, "3x32x32", 128, "graph,compile", ",".join(["allreduce:compile"] + [
                f"allreduce:compile+{k}" for k in _inductor_knobs("pdl", "coop", "pdl+coop", "combo16", "no-mix-order")]))
            for m in ("resnet34",)]), 580),
        # Tenth round: Inductor's options for its reductions and tilings (BatchNorm's kernels), resnet34.
        "tput-knobs10-128": (_gpu_bench(p("tput-knobs10-128"), [
            (m, "3x32x32", 128, "graph,compile", ",".join(["allreduce:compile"] + [
                f"allreduce:compile+{k}" for k in _inductor_knobs("multi-kernel", "tile-red",
                                                                  "nd-tiling", "tile-red+nd-tiling")]))
            for m in ("resnet34",)]), 590),
        "tput-prio": (["bash", "-c", "; ".join([shlex.join(_py(
            os.path.join(HERE, "step_agreement.py"), "--device", "cuda", "--model", "resnet18", "--batch", "128",
            "--steps", "30", "--variants", "allreduce:compile+normal-priority,allreduce:compile",
            "--out", os.path.join(p("tput-prio"), "agree-resnet18-b128.json")))] + _gpu_bench(p("tput-prio"), [
                (m, "3x32x32", b, "graph,compile", "allreduce:compile,allreduce:compile+normal-priority")
                for m, b in (("resnet34", 128), ("resnet18", 128), ("resnet34", 1024))])[2:])], 580),
        # One process per variant and no baseline beside it: cuDNN caches its choice per shape for
        # the process, whatever the limit, and a baseline's convolutions would fill that cache first.
        "tput-cudnn-all": (["bash", "-c", "; ".join(
            _gpu_bench(os.path.join(p("tput-cudnn-all"), sub), [(m, "3x32x32", b, "", v)])[2]
            for m, b in (("resnet34", 128), ("resnet18", 128), ("resnet34", 1024))
            for sub, v in (("default", "allreduce:compile"), ("cudnn-all", "allreduce:compile+cudnn-all")))], 580),
        "roofline-early": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "resnet34",
                               "--batch-sizes", "128", "--precision", "bf16", "--channels-last",
                               "--variants", "compile",
                               "--out", os.path.join(p("roofline-early"), "profile-resnet34.json")), 300),
        # Ninth round: where the critical path waits (main-stream gaps) in the default step, with the
        # side stream's work on it (serial-conv) and the update after the backward (late-update).
        "timeline-34": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "resnet34",
                            "--batch-sizes", "128", "--precision", "bf16", "--channels-last", "--no-roofline",
                            "--variants", "compile,compile+serial-conv,compile+late-update",
                            "--timeline", p("timeline-34"),
                            "--out", os.path.join(p("timeline-34"), "profile-resnet34.json")), 500),
        "timeline-18": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "resnet18",
                            "--batch-sizes", "128", "--precision", "bf16", "--channels-last", "--no-roofline",
                            "--variants", "compile", "--timeline", p("timeline-18"),
                            "--out", os.path.join(p("timeline-18"), "profile-resnet18.json")), 300),
        # The general contract's lazy splits (data/lazy.py) on a GPU: rows written from pinned
        # memory, auto reading whole first there, and the host-memory path (stream) against resident
        # (tests/data/test_lazy.py: its two GPU tests; the rest runs on the CPU there too).
        "gpu-tests-lazy": (["bash", "-c", shlex.join(_py("-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                        "tests/data/test_lazy.py"))], 300),
        # Ninth round: the graph's memset nodes made kernel nodes (the default) against kept.
        "gpu-tests-memset": (["bash", "-c", shlex.join(_py("-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                          "tests/step/test_graph_memsets.py"))], 300),
        "agree-memset": (["bash", "-c", "; ".join(
            shlex.join(_py(os.path.join(HERE, "step_agreement.py"), "--device", "cuda", "--model", m, "--batch",
                           "128", "--steps", "30", "--variants", variants,
                           "--out", os.path.join(p("agree-memset"), f"{m}-b128-{kind}.json")))
            for m, kind, variants in (
                ("resnet18", "compiled", "allreduce:compile+memset-nodes,allreduce:compile"),
                ("resnet18", "eager", "allreduce:memset-nodes,allreduce"),
                ("resnet34", "compiled", "allreduce:compile+memset-nodes,allreduce:compile")))], 500),
        # Every acceptance row, the memset nodes made kernels against kept: tput-memset-* first,
        # tput-final9-* (the ninth round's final table) after the bench's repeat fix (steps_per_repeat).
        **{f"tput-{tag}-{b}": (_gpu_bench(p(f"tput-{tag}-{b}"), [
            (m, "3x32x32", b, "plain,graph,compile", "allreduce:compile,allreduce:compile+memset-nodes")
            for m in ("resnet34", "resnet18", "alexnet-small")]), 580)
           for tag in ("memset", "final9") for b in (128, 1024)},
        "tput-memset-fix": (_gpu_bench(p("tput-memset-fix"), [
            (m, "3x32x32", 128, "graph,compile", "allreduce:compile,allreduce:compile+memset-nodes")
            for m in ("alexnet-small", "resnet34")]), 500),
        # alexnet-small's first shmlearn variant ran 0.224-0.251 ms against 0.217-0.227 for the
        # same step listed second: three identical steps, after the compile baseline and without it.
        "tput-order": (["bash", "-c", "; ".join(
            _gpu_bench(os.path.join(p("tput-order"), sub), [
                ("alexnet-small", "3x32x32", 128, base,
                 "allreduce:compile,allreduce:compile+memset-nodes,allreduce:compile+late-update")])[2]
            for sub, base in (("with-compile", "graph,compile"), ("graph-only", "graph")))], 500),
        "timeline-34m": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "resnet34",
                             "--batch-sizes", "128", "--precision", "bf16", "--channels-last", "--no-roofline",
                             "--variants", "compile,compile+memset-nodes", "--timeline", p("timeline-34m"),
                             "--out", os.path.join(p("timeline-34m"), "profile-resnet34.json")), 400),
        # Eleventh round: the update writes the convolutions' bf16 weights (--weight-copy auto) and
        # the forward casts none; bit for bit first, then every acceptance row against the casts.
        "agree-copy": (["bash", "-c", "; ".join(
            shlex.join(_py(os.path.join(HERE, "step_agreement.py"), "--device", "cuda", "--model", m, "--batch",
                           str(b), "--steps", "30", "--variants", variants,
                           "--out", os.path.join(p("agree-copy"), f"{m}-b{b}-{kind}.json")))
            for m, b, kind, variants in AGREE_COPY)], 500),
        **{f"tput-copy-{b}": (_gpu_bench(p(f"tput-copy-{b}"), [
            (m, "3x32x32", b, "plain,graph,compile", "allreduce:compile,allreduce:compile+no-weight-copy")
            for m in ("resnet34", "resnet18", "alexnet-small")]), 580) for b in (128, 1024)},
        "tput-copy-late-128": (_gpu_bench(p("tput-copy-late-128"), [
            (m, "3x32x32", 128, "graph", "allreduce:compile+late-update,allreduce:compile+late-update+no-weight-copy")
            for m in ("resnet34", "resnet18")]), 400),
        "kernels-copy": (_py(os.path.join(HERE, "kernels.py"), "--cases", "flat-sgd-copy", "--batch-sizes", "128",
                             "--out", os.path.join(p("kernels-copy"), "kernels-flat-sgd-copy.json")), 200),
        "tput-copy5-128": (_gpu_bench(p("tput-copy5-128"), [
            (m, "3x32x32", 128, "graph,compile", "allreduce:compile,allreduce:compile+weight-copy")
            for m in ("resnet34", "resnet18")]), 400),
        "timeline-34c": (_py(os.path.join(HERE, "throughput_profile.py"), "--model", "resnet34",
                             "--batch-sizes", "128", "--precision", "bf16", "--channels-last", "--no-roofline",
                             "--variants", "compile,compile+no-weight-copy", "--timeline", p("timeline-34c"),
                             "--out", os.path.join(p("timeline-34c"), "profile-resnet34.json")), 400),
        # Twelfth round: the batch read compiled with the model (--compile; StepOptions.compile_read)
        # against it run eagerly (eager-read). Its GPU test first; then every acceptance row of
        # issue 18 in one run each, with every baseline at 128 (compile-max too); the traces.
        "gpu-tests-12": (["bash", "-c", shlex.join(_py("-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                      "tests/data/test_loader.py", "-k", "compiled"))], 300),
        "tput-final12-128": (_gpu_bench(p("tput-final12-128"), [
            (m, "3x32x32", 128, MAX4, "allreduce:compile,allreduce:compile+eager-read")
            for m in ("resnet34", "resnet18", "alexnet-small")]), 1200),
        "tput-final12-1024": (_gpu_bench(p("tput-final12-1024"), [
            (m, "3x32x32", 1024, "plain,graph,compile", "allreduce:compile,allreduce:compile+eager-read")
            for m in ("resnet34", "resnet18", "alexnet-small")]), 900),
        "timeline-12": (["bash", "-c", "; ".join(
            f"{sys.executable} {os.path.join(HERE, 'throughput_profile.py')} --model {m} --batch-sizes 128 "
            f"--precision bf16 --channels-last --no-roofline --variants compile,compile+eager-read "
            f"--timeline {p('timeline-12')} --out {p('timeline-12')}/profile-{m}.json"
            for m in ("resnet34", "alexnet-small"))], 600),
        # Two GPUs (run with --workers 1,2 on nvidia-h100-x2): where alexnet-small's gradient average
        # costs 170-440 us a step when a bare all_reduce of its 0.6 MB takes 62 us
        # (results/h100x2/). The trained run's phase times (summary.json phase_s, CUDA
        # events on the sampled eager steps) at 1 and 2 GPUs, and the bare all_reduce after 1 ms of
        # computation on every rank, as in a step, against back to back.
        "x2-probe": (["bash", "-c", "; ".join(
            [f"{sys.executable} -m shmlearn train --device cuda --workers {w} --model alexnet-small "
             f"--dataset fashion-mnist --data-dir {os.path.join(ROOT_DIR, 'data', 'fashion-mnist')} --batch-size 1024 "
             f"--precision bf16 --channels-last --compile default --samples 3000000 --no-progress "
             f"--out {p('x2-probe')}/train-w{w} && {sys.executable} -c \"import json; "
             f"s=json.load(open('{p('x2-probe')}/train-w{w}/summary.json')); "
             f"print('W={w}', s['samples_per_s'], s['step_mode'], s['phase_s'])\"" for w in (1, 2)]
            + [f"{sys.executable} -m shmlearn bench comm --backend nccl --workers 2 --ops all_reduce "
               f"--sizes 512K,1M --budget-s 0.5 --compute-ms {ms} --no-plot "
               f"--out {p('x2-probe')}/comm-compute{ms}ms.json" for ms in (0, 1)])], 400),
        # Issue 36: every default GPU path. The CLI as a user runs it (every built-in model with
        # default flags, fp32 and bf16, four at a time over the GPUs; a default GPU sweep), then
        # the GPU matrix at 1 worker (two shards, one per GPU) and at 2, then the speed check.
        "cli-36": (["bash", "-c", _cli_defaults(p("cli-36"))], 420),
        "matrix-w1": (["bash", "-c", " & ".join(
            f"CUDA_VISIBLE_DEVICES={i} {sys.executable} {os.path.join(HERE, 'gpu_matrix.py')} --workers 1 "
            f"--shard {i}/2 --out {p('matrix-w1')}/shard{i}.json > {p('matrix-w1')}/shard{i}.log 2>&1"
            for i in range(2)) + f" & wait; {sys.executable} {os.path.join(HERE, 'gpu_matrix.py')} --merge "
            f"{p('matrix-w1')}/shard0.json {p('matrix-w1')}/shard1.json --out {p('matrix-w1')}/gpu-matrix-w1.json"],
            600),
        "matrix-w2": (_py(os.path.join(HERE, "gpu_matrix.py"), "--workers", "2",
                          "--out", os.path.join(p("matrix-w2"), "gpu-matrix-w2.json")), 600),
        # Issue 51: the user's recipe cells of the matrix (AdamW, RMSprop, NAdam, Adagrad in the fast
        # step, clipping, accumulation) at 1 worker and at 2.
        "matrix-51": (["bash", "-c", "; ".join(
            f"{sys.executable} {os.path.join(HERE, 'gpu_matrix.py')} --workers {w} "
            f"--only /adamw,/clip,/accumulate,/rmsprop,/nadam,/adagrad "
            f"--out {p('matrix-51')}/gpu-matrix-51-w{w}.json" for w in (1, 2))], 900),
        # Issue 51: a user's ViT-tiny and GPT-style LM with AdamW (the LM clipped) through shmlearn.train
        # against DDP and DDP + compile at 1, 2 and 4 GPUs (as many as the machine has); or one workload a part.
        "user-workloads": (_py(os.path.join(HERE, "user_workloads.py"), "--gpus", "1,2,4",
                               "--out", os.path.join(p("user-workloads"), "user_workloads.json")), 1800),
        # Issue 51 in one lease: the workloads at 1 GPU (GPU 0) and 2 GPUs (GPUs 1,2) side by side
        # (uw-12), then at 4 (uw-4); each side 3 windows of 200 steps after 50 of warm-up.
        "uw-12": (["bash", "-c", _uw(p("uw-12"), [("0", "1"), ("1,2", "2")])], 900),
        "uw-4": (["bash", "-c", _uw(p("uw-4"), [("0,1,2,3", "4")])], 900),
        # Issue 51: the same with shmlearn compiled only (step/regions.py: block by block at 2 GPUs and more).
        "uw-c12": (["bash", "-c", _uw(p("uw-c12"), [("0", "1"), ("1,2", "2")], "default")], 900),
        "uw-c4": (["bash", "-c", _uw(p("uw-c4"), [("0,1,2,3", "4")], "default")], 900),
        # On a machine of 2 GPUs: 1 GPU, then 2.
        "uw-c2": (["bash", "-c", _uw(p("uw-c2"), [("0", "1")], "default") + "; "
                   + _uw(p("uw-c2"), [("0,1", "2")], "default")], 900),
        # Issue 55 on 2 GPUs, correctness only, side by side: the matrix at 1 and 2 workers, its
        # fashion-net compiled ps cell 10 times, and the seed's alexnet-sweep grid at workers 1, 2.
        "mix2": (["bash", "-c", f"mkdir -p {p('mix2')}/fn-10; (" + _matrix_all(p("mix2"), big) + ") & ("
                  + " & ".join(
                      f"CUDA_VISIBLE_DEVICES={i % int(big)} {sys.executable} {os.path.join(HERE, 'gpu_matrix.py')} "
                      f"--workers 1 --only fashion-net/fp32/ps/W1/compile --out {p('mix2')}/fn-10/run{i}.json "
                      f"> {p('mix2')}/fn-10/run{i}.log 2>&1" for i in range(10)) + " & wait) & ("
                  + shlex.join(_py(*sh, "experiment", "run", "alexnet-sweep", "--device", "cuda",
                                   "--out", os.path.join(p("mix2"), "alexnet-sweep")))
                  + f" > {p('mix2')}/alexnet-sweep.log 2>&1) & wait; grep -h -o '\"verdict\": \"[a-z-]*\"' "
                  + f"{p('mix2')}/fn-10/run*.json | sort | uniq -c; tail -n 30 {p('mix2')}/alexnet-sweep.log"], 1100),
        **{f"user-workloads-{w}": (_py(os.path.join(HERE, "user_workloads.py"), "--gpus", "1,2,4", "--workloads", w,
                                       "--out", os.path.join(p(f"user-workloads-{w}"), f"user_workloads_{w}.json")), 900)
           for w in ("vit", "lm")},
        "tput-36": (_gpu_bench(p("tput-36"), [
            (m, "3x32x32", b, "graph", "allreduce:compile") for b in (128, 1024) for m in ("alexnet-small", "resnet18")]),
            600),
        # Issues 37/42: each rank's step split into host issue time and GPU time at 1, 2 and 4 GPUs
        # (benchmarks/multi_gpu_probe.py), then with fewer intra-op threads, with each rank pinned
        # to its own cores, as independent processes with no process group, and a trace at 2.
        "probe-42": (["bash", "-c", _probe_42(p("probe-42"), big)], 560),
        # Issue 36: the one W=1 matrix cell that missed (resnet18 fp32 ps --compile default), with
        # each of the step's defaults undone alone, several at once over the GPUs.
        "r18-diag": (["bash", "-c", _r18_diag(p("r18-diag"), big)], 400),
        # Issue 55: the W=1 matrix cell that drifted once (fashion-net fp32 ps --compile default),
        # run 10 times, each its own process, over the GPUs (Inductor's cache warm after the first).
        "fn-10": (["bash", "-c", " & ".join(
            f"CUDA_VISIBLE_DEVICES={i % int(big)} {sys.executable} {os.path.join(HERE, 'gpu_matrix.py')} --workers 1 "
            f"--only fashion-net/fp32/ps/W1/compile --out {p('fn-10')}/run{i}.json > {p('fn-10')}/run{i}.log 2>&1"
            for i in range(10)) + " & wait; grep -h -o '\"verdict\": \"[a-z-]*\"' " + p("fn-10") + "/run*.json | sort | uniq -c"],
                  400),
        # Issues 54 and 55 after the package move: the whole matrix at 1 and 2 workers beside the
        # fashion-net compiled ps cell 10 times (correctness only).
        "mix54": (["bash", "-c", f"mkdir -p {p('mix54')}/fn-10; (" + _matrix_all(p("mix54"), big) + ") & ("
                   + " & ".join(
                       f"CUDA_VISIBLE_DEVICES={i % int(big)} {sys.executable} {os.path.join(HERE, 'gpu_matrix.py')} "
                       f"--workers 1 --only fashion-net/fp32/ps/W1/compile --out {p('mix54')}/fn-10/run{i}.json "
                       f"> {p('mix54')}/fn-10/run{i}.log 2>&1" for i in range(10)) + " & wait) & wait; "
                   + f"grep -h -o '\"verdict\": \"[a-z-]*\"' {p('mix54')}/fn-10/run*.json | sort | uniq -c"], 900),
        # Issue 52: cold and warm start on the GPU as a user runs it: start.py's floor and default
        # alexnet-small run (cold: empty shmlearn, Triton and Inductor caches), then fashion-94 on
        # two GPUs (recipes/fashion-94-2gpu.yaml) cold, then warm twice, each timed from outside.
        # Issue 52 after the flat-update rule and GPU pools from the forkserver: start.py on ONE GPU
        # (cold: empty caches; warm), beside fashion-94 on GPUs 2 and 3 cold and warm twice.
        "start56": (["bash", "-c", "CUDA_VISIBLE_DEVICES=0 " + shlex.join(_py(
            os.path.join(HERE, "start.py"), "--device", "cuda", "--repeats", "1", "--cases", "floor,train",
            "--out", os.path.join(p("start56"), "start-gpu.json"))) + f" > {p('start56')}/start.log 2>&1 & "
            + "(export CUDA_VISIBLE_DEVICES=2,3; " + _fashion94_starts(p("start56")) + ") & wait; "
            + f"tail -n 5 {p('start56')}/start.log"], 400),
        # Issues 52 and 55: the seed's alexnet-sweep grid at workers 1, 2, 4 on four GPUs (its
        # efficiency, the paper's winners with margins and time-to-accuracy winners), then the
        # default GPU sweep (8 trials).
        "sweeps56": (["bash", "-c", _sweeps(p("sweeps56"))], 560),
        # Issue 52, session 27: lean GPU pools (no torch._dynamo in the forkserver or the workers
        # where nothing compiles). Their tests on GPUs 0,1 beside a py-spy profile of 1-worker
        # trials on GPU 2 (where a trial's setup goes); then, alone on the four GPUs, the seed's
        # sweep, the same with cuDNN's heuristics instead of its timing (--axis
        # cudnn_benchmark=off), and the default 8-trial sweep as shipped and with Python's
        # bytecode cache (filled once, then timed).
        "s27": (["bash", "-c", _s27(p("s27"), int(big))], 900),
        "s27b": (["bash", "-c", _s27b(p("s27b"))], 400),
        "s27c": (["bash", "-c", _s27c(p("s27c"))], 560),
        "s27d": (["bash", "-c", _s27d(p("s27d"))], 560),
        # Issue 52 acceptance 3 with lean pools: a short sweep to warm the fresh machine (its first
        # run pays ~4 s a GPU process), then the seed's whole grid on every GPU, then the default sweep.
        "s27x": (["bash", "-c", shlex.join(_py(
            "-m", "shmlearn", "sweep", "--device", "cuda", "--model", "alexnet-small", "--dataset", "fashion-mnist",
            "--data-dir", os.path.join(ROOT_DIR, "data", "fashion-mnist"), "--workers", "1,2", "--batch-size", "64",
            "--lr", "0.1", "--samples", "8192", "--no-report", "--out", os.path.join(p("s27x"), "warm")))
            + f" > {p('s27x')}/warm.log 2>&1; " + _sweeps(p("s27x"))], 400),
        # Issue 52: fashion-94 on two GPUs, cold and warm, with and without Python's bytecode cache.
        "f94-26": (["bash", "-c", "export CUDA_VISIBLE_DEVICES=0,1; " + _fashion94_pyc(p("f94-26"))], 420),
        "f94-26b": (["bash", "-c", "export CUDA_VISIBLE_DEVICES=0,1; " + _fashion94_pyc(
            p("f94-26b"), ("cold", "pyc-fill", "pyc-warm1", "pyc-warm2", "pyc-warm3", "warm1"))], 300),
        # The 2-worker cells the session-26 matrix's time limit left out, 3 at a time on GPUs 0,1.
        "m9-26": (["bash", "-c", _matrix_all(p("m9-26"), "2", w1_per_gpu=0, w2_per_pair=3, only=",".join((
            "alexnet-small/fp32/allreduce/W2/clip+accumulate=2+grad-buckets=on+no-graph",
            "fashion-net/fp32/allreduce/W2/grad-buckets=on", "fashion-net/fp32/ps/W2/clip+accumulate=2",
            "lenet/fp32/weight-avg/W2/accumulate=2", "lenet/fp32/weight-avg/W2/clip+accumulate=2",
            "resnet18/bf16/allreduce/W2/clip+accumulate=2+grad-buckets=on+compile",
            "resnet18/bf16/allreduce/W2/clip+accumulate=2+grad-buckets=on+no-graph",
            "resnet18/bf16/allreduce/W2/grad-buckets=on", "resnet18/fp32/allreduce/W2/grad-buckets=off")))], 300),
        # Session 29, one GPU: the GPU tests of the capture cache and the evaluation graph (b10b1b7
        # unchecked there), acceptance 4's throughput at 1 GPU, then the W=1 matrix in 4 shards.
        "s29": (["bash", "-c", f"timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs tests/train/test_eval_graph.py "
                 f"tests/step/test_capture_again.py tests/launch/test_lean_gpu.py > {p('s29')}/gpu-tests.log 2>&1; "
                 f"echo tests rc=$?; tail -n 15 {p('s29')}/gpu-tests.log; "
                 + _scale_bench(p("s29"), "1", [("alexnet-small", 1024, True), ("resnet18", 512, "allreduce")],
                                baselines="local")[2] + "; "
                 + _matrix_all(p("s29"), "1", w1_per_gpu=4)], 900),
        # Session 29, one GPU, after the API's lean pools and the CPU's shared-memory average: the
        # lean GPU tests, the CPU average's tests on this host's CPU, GPU runs that must not take it
        # (one GPU; two ranks on it over Gloo), a short GPU sweep, and the one-GPU start, cold and warm.
        "s29b": (["bash", "-c", f"timeout 420 python3 -m pytest -q -p no:cacheprovider -rfEs -n 4 "
                  f"tests/launch/test_lean_gpu.py tests/sync/test_shm.py tests/sync/test_equivalence.py "
                  f"> {p('s29b')}/tests.log 2>&1; echo tests rc=$?; tail -n 8 {p('s29b')}/tests.log; "
                  + shlex.join(_py("-m", "shmlearn", "train", "--device", "cuda", "--workers", "2", "--backend", "gloo",
                                   "--dataset", "digits", "--model", "mlp", "--no-progress",
                                   "--out", os.path.join(p("s29b"), "gloo-gpu"))) + "; echo gloo-gpu rc=$?; "
                  + "python3 -c \"import json,sys; s=json.load(open(sys.argv[1])); print('collectives', s['collectives'], "
                  + "s['collectives_note'], s['step_mode'], s['final_loss'])\" " + os.path.join(p("s29b"), "gloo-gpu", "summary.json")
                  + "; " + shlex.join(_py("-m", "shmlearn", "sweep", "--device", "cuda", "--model", "alexnet-small",
                                          "--dataset", "fashion-mnist", "--data-dir",
                                          os.path.join(ROOT_DIR, "data", "fashion-mnist"), "--workers", "1",
                                          "--batch-size", "64,256", "--lr", "0.05,0.1", "--samples", "60000",
                                          "--out", os.path.join(p("s29b"), "sweep")))
                  + f" > {p('s29b')}/sweep.log 2>&1; echo sweep rc=$?; tail -n 3 {p('s29b')}/sweep.log; "
                  + shlex.join(_py(os.path.join(HERE, "start.py"), "--device", "cuda", "--repeats", "2",
                                   "--cases", "floor,train", "--out", os.path.join(p("s29b"), "start-gpu.json")))
                  + f" > {p('s29b')}/start.log 2>&1; tail -n 8 {p('s29b')}/start.log"], 900),
        # Session 29, one GPU, the last checks: two ranks on the one GPU over Gloo with each strategy
        # that may use shared memory on the CPU (they must not here: CUDA buffers), then the W=1 matrix.
        "s29c": (["bash", "-c", f"CUDA_VISIBLE_DEVICES= timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 "
                  f"tests/sync/test_shm.py > {p('s29c')}/shm-tests.log 2>&1; echo shm tests rc=$?; "
                  f"tail -n 3 {p('s29c')}/shm-tests.log; " + "; ".join(
            shlex.join(_py("-m", "shmlearn", "train", "--device", "cuda", "--workers", "2", "--backend", "gloo",
                           "--dataset", "digits", "--model", "mlp", "--strategy", strat, "--samples", "16384",
                           "--no-progress", "--out", os.path.join(p("s29c"), strat)))
            + f" > {p('s29c')}/{strat}.log 2>&1; echo {strat} rc=$?; tail -n 1 {p('s29c')}/{strat}.log"
            for strat in ("allreduce", "ps", "weight-avg")) + "; " + _matrix_all(p("s29c"), "1", w1_per_gpu=4)], 900),
        # Session 29: the W=1 matrix again after the Gloo-on-GPU capture change (step/graphs.py).
        "s29d": (["bash", "-c", _matrix_all(p("s29d"), "1", w1_per_gpu=4)], 400),
        # Session 30, one GPU: the shared-memory mailbox's and collectives' tests on this host's CPU
        # (16 cores), async-ps with its ranks on the GPU (Gloo; they must not take shared memory),
        # the default 4-trial GPU sweep twice, the one-GPU start, then the W=1 matrix.
        "s30": (["bash", "-c", f"CUDA_VISIBLE_DEVICES= timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 "
                 f"tests/sync/test_shm.py tests/sync/test_shm_mailbox.py tests/sync/test_async_ps.py "
                 f"> {p('s30')}/cpu-tests.log 2>&1; echo cpu tests rc=$?; tail -n 4 {p('s30')}/cpu-tests.log; "
                 + shlex.join(_py("-m", "shmlearn", "train", "--device", "cuda", "--workers", "3", "--backend", "gloo",
                                  "--strategy", "async-ps", "--dataset", "digits", "--model", "mlp", "--samples", "16384",
                                  "--no-progress", "--out", os.path.join(p("s30"), "async-gpu")))
                 + f" > {p('s30')}/async-gpu.log 2>&1; echo async-gpu rc=$?; tail -n 1 {p('s30')}/async-gpu.log; "
                 + "python3 -c \"import json,sys; s=json.load(open(sys.argv[1])); print('collectives', s['collectives'], "
                 + "s['collectives_note'], s['step_mode'], s['final_loss'])\" " + os.path.join(p("s30"), "async-gpu", "summary.json")
                 + "; " + "; ".join(shlex.join(_py("-m", "shmlearn", "sweep", "--device", "cuda", "--model", "alexnet-small",
                                                  "--dataset", "fashion-mnist", "--data-dir",
                                                  os.path.join(ROOT_DIR, "data", "fashion-mnist"), "--workers", "1",
                                                  "--batch-size", "64,256", "--lr", "0.05,0.1", "--samples", "60000",
                                                  "--out", os.path.join(p("s30"), f"sweep-{i}")))
                                    + f" > {p('s30')}/sweep-{i}.log 2>&1; echo sweep-{i} rc=$?; "
                                    f"grep 'sweep: ran' {p('s30')}/sweep-{i}.log" for i in range(2)) + "; "
                 + shlex.join(_py(os.path.join(HERE, "start.py"), "--device", "cuda", "--repeats", "2",
                                  "--cases", "floor,train", "--out", os.path.join(p("s30"), "start-gpu.json")))
                 + f" > {p('s30')}/start.log 2>&1; tail -n 8 {p('s30')}/start.log; "
                 + _matrix_all(p("s30"), "1", w1_per_gpu=4)], 900),
        # Session 31, one GPU: a model's buffers in one collective per dtype (sync/base.py through_flat)
        # on CUDA tensors: two ranks on the one GPU over Gloo, fashion-net (BatchNorm) with evaluations
        # between weight-avg's rounds; then the W=1 matrix.
        "s31": (["bash", "-c", "; ".join(
            shlex.join(_py("-m", "shmlearn", "train", "--device", "cuda", "--workers", "2", "--backend", "gloo",
                           "--dataset", "fashion-mnist", "--data-dir", os.path.join(ROOT_DIR, "data", "fashion-mnist"),
                           "--model", "fashion-net", "--strategy", strat, *extra, "--samples", "16384",
                           "--eval-points", "4", "--no-progress", "--out", os.path.join(p("s31"), strat)))
            + f" > {p('s31')}/{strat}.log 2>&1; echo {strat} rc=$?; tail -n 2 {p('s31')}/{strat}.log"
            for strat, extra in (("allreduce", []), ("weight-avg", ["--avg-period", "3"]), ("ps", [])))
            + "; " + _matrix_all(p("s31"), "1", w1_per_gpu=4)], 900),
        # Issue 52 acceptance 4: bench throughput alexnet-small b1024 compiled and resnet18 b512 at 1 and 4 GPUs.
        "tput56": (_scale_bench(p("tput56"), "1,4", [("alexnet-small", 1024, True), ("resnet18", 512, "allreduce")],
                                baselines="local"), 560),
        "cold52": (["bash", "-c", shlex.join(_py(os.path.join(HERE, "start.py"), "--device", "cuda", "--repeats", "1",
                                                 "--cases", "floor,train",
                                                 "--out", os.path.join(p("cold52"), "start-gpu.json")))
                    + "; " + _fashion94_starts(p("cold52"))], 560),
        # Issue 36: the whole matrix at 1 and 2 workers at once on every GPU (W=1: two shards a GPU;
        # W=2: two shards a pair of GPUs), then merged.
        "matrix-all": (["bash", "-c", _matrix_all(p("matrix-all"), big)], 720),
        # Issue 38: the matrix's --compile cells (29 of 160) at 1 and 2 workers, after the compile's
        # eager fallback (a lease of 2 GPUs has no room for the whole matrix beside the benches).
        "matrix-c": (["bash", "-c", _matrix_all(p("matrix-c"), big, w1_per_gpu=2, w2_per_pair=6, only="compile")],
                     590),
        # Issue 37: a default GPU sweep at workers 1,2 over every GPU (1-worker trials side by side).
        "sweep-37": (["bash", "-c", shlex.join(_py(
            "-m", "shmlearn", "sweep", "--device", "cuda", "--model", "alexnet-small", "--dataset", "fashion-mnist",
            "--data-dir", os.path.join(ROOT_DIR, "data", "fashion-mnist"), "--workers", "1,2", "--batch-size", "64,256",
            "--lr", "0.05,0.1", "--samples", "60000", "--out", os.path.join(p("sweep-37"), "sweep")))
            + f"; echo sweep rc=$?; wc -l {p('sweep-37')}/sweep/results.jsonl"], 240),
        # Issues 37/42: scaling at 1, 2 and 4 GPUs against DDP and DDP + compile, one bench run a model.
        "scale-42": (_scale_bench(p("scale-42"), workers, [
            ("alexnet-small", 1024, True), ("resnet18", 512, True), ("alexnet-small", 128, True),
            ("resnet34", 256, True)]), 590),
        # Issues 37/42: resnet18 and resnet34 at 1, 2, 4 GPUs with the average in buckets during
        # the backward (uncompiled: `allreduce`), without (`allreduce:no-buckets`) and compiled.
        "scale-r": (_scale_bench(p("scale-r"), workers, [
            ("resnet18", 512, "allreduce,allreduce:no-buckets,allreduce:compile"),
            ("resnet34", 256, "allreduce,allreduce:no-buckets,allreduce:compile")]), 590),
        "scale-a": (_scale_bench(p("scale-a"), workers, [("alexnet-small", 1024, True), ("alexnet-small", 128, True)]),
                    590),
        # Issues 37/42: the default (uncompiled, buckets) step of resnet18 and resnet34 at 1, 2, 4 GPUs.
        "scale-r2": (_scale_bench(p("scale-r2"), workers, [("resnet18", 512, "allreduce"),
                                                             ("resnet34", 256, "allreduce")]), 590),
        # Issue 42 acceptance 1 and 2 in one batch: alexnet-small compiled b1024 and the resnets'
        # default step at 1, 2, 4 GPUs with local, DDP and DDP + compile, back to back.
        "scale-4": (_scale_bench(p("scale-4"), workers, [("alexnet-small", 1024, True), ("resnet18", 512, "allreduce"),
                                                           ("resnet34", 256, "allreduce")]), 900),
        # Issue 38 acceptance 3: the fused-kernel files that failed on the host's AVX512 Xeon, under
        # avx2 and avx512 (a failure under both is torch 2.11's Triton, not the vector width), and the
        # async-ps files alone (no other test processes pacing them).
        "avx-diag": (["bash", "-c", "; ".join(
            f"echo '#### {cap} {files}'; CUDA_VISIBLE_DEVICES= ATEN_CPU_CAPABILITY={cap} timeout 200 "
            f"python3 -m pytest -q -p no:cacheprovider -n {n} --tb=short -rfE {files}"
            for cap, n, files in (
                ("avx2", 8, "tests/nn/test_conv_pool.py tests/nn/test_mlp_head.py tests/nn/test_conv_overlap.py"),
                ("avx512", 8, "tests/nn/test_conv_pool.py tests/nn/test_mlp_head.py tests/nn/test_conv_overlap.py"),
                ("avx512", 4, "tests/sync/test_async_ps.py")))], 600),
        # Issue 38 acceptance 3: the whole suite under AVX512 on the host's CPU (xdist, no GPU).
        "avx512-suite": (["bash", "-c", "CUDA_VISIBLE_DEVICES= ATEN_CPU_CAPABILITY=avx512 timeout 560 python3 -m "
                          "pytest -p no:cacheprovider -n 24 -v --tb=short -rfE tests; echo rc=$?"], 600),
        # Issue 42 acceptance 1 after the steps-per-repeat fix (eaba455): alexnet-small compiled
        # b1024 at 1, 2, 4 GPUs, `local` beside DDP and DDP + compile.
        "scale-4a": (_scale_bench(p("scale-4a"), workers, [("alexnet-small", 1024, True)]), 420),
        # Issue 38 acceptance 3: the abort inside Inductor-compiled CPU code of test_conv_overlap
        # (torch 2.11, avx512 only?): each width with a fresh Inductor cache, then the generated
        # code around the line the abort names.
        "avx-abort": (["bash", "-c", _avx_abort(p("avx-abort"))], 560),
        # Issue 38 acceptance 3: the whole suite under AVX512, 16 xdist workers with 2 threads each
        # (the 2-core machine's thread count), failures written as they happen.
        "avx512-suite2": (["bash", "-c", f"CUDA_VISIBLE_DEVICES= ATEN_CPU_CAPABILITY=avx512 OMP_NUM_THREADS=2 "
                           f"PYTHONPATH=$PWD/benchmarks:$PWD LIVE_FAILURES={p('avx512-suite2')}/failures.txt timeout 540 "
                           "python3 -m pytest -p no:cacheprovider -p pytest_live_failures -n 16 --dist loadfile "
                           "-q --tb=short -rfE --durations=30 tests; echo rc=$?"], 570),
        # Issue 38 acceptance 3: the README's test command (-n 2) under AVX512 on two of the
        # host's cores (taskset: a 2-core machine), failures written as they happen.
        "suite-2core": (["bash", "-c", "grep -q avx512f /proc/cpuinfo || { echo 'no AVX512 on this CPU'; exit 3; }; "
                         "lscpu | grep 'Model name'; export CUDA_VISIBLE_DEVICES= ATEN_CPU_CAPABILITY=avx512 "
                         f"PYTHONPATH=$PWD/benchmarks:$PWD LIVE_FAILURES={p('suite-2core')}/failures.txt; "
                         "taskset -c 0,1 python3 -c 'import torch, os; print(torch.__version__, "
                         "torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), len(os.sched_getaffinity(0)))'; "
                         "time taskset -c 0,1 timeout 1500 python3 -m pytest -p no:cacheprovider -p pytest_live_failures "
                         "-n 2 -q -rfE --durations=40 tests; echo rc=$?"], 1560),
        # The same on the whole host (8 test processes of 2 threads each), where a 2-core run does
        # not fit the device time left.
        "suite-n8": (["bash", "-c", "grep -q avx512f /proc/cpuinfo || { echo 'no AVX512 on this CPU'; exit 3; }; "
                      "export CUDA_VISIBLE_DEVICES= ATEN_CPU_CAPABILITY=avx512 OMP_NUM_THREADS=2 "
                      f"PYTHONPATH=$PWD/benchmarks:$PWD LIVE_FAILURES={p('suite-n8')}/failures.txt; "
                      "time timeout 1000 python3 -m pytest -p no:cacheprovider -p pytest_live_failures "
                      "-n 8 -q -rfE --durations=40 tests; echo rc=$?"], 1060),
        # Issue 37: cnn's batch x lr table (seed 003 §4: lenet, Adam, 10 epochs) at 2 GPUs, a
        # 2-worker sweep (two trials side by side on 4 GPUs); then acceptance 2's bare NCCL
        # all_reduce of alexnet-small's gradient (147,338 fp32 = 576 KiB with the loss) at 2 and 4 GPUs.
        "cnn-2": (["bash", "-c", shlex.join(_py(
            *sh, "sweep", "--device", "cuda", "--model", "lenet", "--dataset", "fashion-mnist",
            "--data-dir", os.path.join(ROOT_DIR, "data", "fashion-mnist"), "--workers", "2",
            "--batch-size", "32,64,128", "--lr", "0.01,0.001,0.0001", "--optimizer", "adam",
            "--lr-schedule", "constant", "--epochs", "10", "--eval-points", "5",
            "--out", os.path.join(p("cnn-2"), "sweep"))) + "; echo sweep rc=$?; " + shlex.join(_py(
            *sh, "bench", "comm", "--backend", "nccl", "--workers", "2,4", "--ops", "all_reduce",
            "--sizes", "512K,576K,1M,4M", "--out", os.path.join(p("cnn-2"), "comm-nccl.json")))], 560),
        # Issue 37: fashion-94 at 2 workers (four settings), cpu-vs-gpu's 2-GPU rows.
        "duo2": (["bash", "-c", _duo2(p("duo2"))], 590),
        # Issue 42 acceptance 2: resnet34 at 1, 2, 4 GPUs (scale-42 ran out of time before it).
        "scale-34": (_scale_bench(p("scale-34"), workers, [("resnet34", 256, True)]), 590),
        # Issue 42 acceptance 3: the seed's whole alexnet-sweep grid at workers 1, 2, 4 on 4 GPUs.
        "grid-124": (_py(*sh, "experiment", "run", "alexnet-sweep", "--device", "cuda",
                         "--out", os.path.join(p("grid-124"), "alexnet-sweep")), 590),
        # Issue 37: the same grid at workers 1, 2 on two GPUs (0, 1), and fashion-94 at 2 workers
        # on the other two (global batch 512 as on one GPU; and 512 a GPU at twice the lr), then
        # fashion-94 on one GPU on this machine for the ratio.
        "duo": (["bash", "-c", _duo(p("duo"))], 590),
        # Issues 37 and 42: cnn data parallel at 1, 2, 4 GPUs up to a global batch of 8192 (one
        # cell of the 1-GPU batch x lr table, which is committed from an H100 run).
        "cnn-124": (_py(*sh, "experiment", "run", "cnn", "--device", "cuda", "--axis", "batch_size=128",
                        "--axis", "lr=0.001", "--out", os.path.join(p("cnn-124"), "cnn")), 500),
        # Issue 37: cpu-vs-gpu with its 2-GPU rows (GPUs 0 and 1).
        "cpu-vs-gpu-2": (["bash", "-c", "CUDA_VISIBLE_DEVICES=0,1 " + shlex.join(_py(
            *sh, "experiment", "run", "cpu-vs-gpu", "--device", "cuda",
            "--out", os.path.join(p("cpu-vs-gpu-2"), "cpu-vs-gpu")))], 500),
        "cpu-vs-gpu": (_py(*sh, "experiment", "run", "cpu-vs-gpu", "--device", "cuda",
                           "--out", os.path.join(p("cpu-vs-gpu"), "cpu-vs-gpu")), 300),
    }


def _done(root, name):
    path = os.path.join(root, f"{name}.done")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def _alive(root) -> bool:
    try:
        with open(os.path.join(root, "runner.pid")) as f:
            pid = int(f.read())
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # a dead runner nobody reaped is a zombie, not alive
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def run_parts(a) -> int:
    """The detached runner: every part not done yet, in order."""
    if not os.path.exists(FASHION) and os.path.isdir(os.path.join(ROOT_DIR, "data", "fashion-mnist")):
        os.makedirs(os.path.dirname(FASHION), exist_ok=True)  # the readers' default place
        os.symlink(os.path.join(ROOT_DIR, "data", "fashion-mnist"), FASHION)
    p = lambda name: os.path.join(a.root, name)
    cmds = part_commands(p, a.workers)
    env = dict(os.environ, PYTHONPATH=ROOT_DIR, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", MPLBACKEND="Agg")
    for name in a.parts.split(","):
        if _done(a.root, name):
            continue
        cmd, limit = cmds[name]
        os.makedirs(p(name), exist_ok=True)
        t0 = time.time()
        with open(os.path.join(p(name), "log.txt"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT_DIR,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)  # the sweep records what finished, then stops
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = f"timeout after {limit} s"
        with open(os.path.join(a.root, f"{name}.done"), "w") as f:
            json.dump({"rc": rc, "seconds": round(time.time() - t0, 1)}, f)
    return 0


def _snapshot(root: str) -> str:
    """A copy of the tree (data included) that the parts run from: the device tool rewrites the
    working tree at every call, and a part's processes that import shmlearn meanwhile failed
    (`No module named 'shmlearn.step.fast'` in the matrix's pool workers, 2026-11-27)."""
    src = os.path.join(root, "src")
    if not os.path.isdir(src):
        shutil.copytree(ROOT_DIR, src + ".tmp", symlinks=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", ".whl", ".gl"))
        os.rename(src + ".tmp", src)
    return src


def start(a) -> int:
    os.makedirs(a.root, exist_ok=True)
    if _alive(a.root):
        print("device_suite: runner already running")
        return 0
    src = _snapshot(a.root)
    log = open(os.path.join(a.root, "runner.log"), "a")
    proc = subprocess.Popen(_py(os.path.join(src, "benchmarks", "device_suite.py"), "run", "--parts", a.parts,
                                "--workers", a.workers, "--root", a.root), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=src)
    with open(os.path.join(a.root, "runner.pid"), "w") as f:  # here, not in the child: no race with collect
        f.write(str(proc.pid))
    print(f"device_suite: started {a.parts}", flush=True)
    return 0


def _skip(info: tarfile.TarInfo):
    base = os.path.basename(info.name)
    if base == "trace.json" or "checkpoint" in info.name or base.endswith((".pt", ".safetensors")):
        return None
    return info


def collect(a) -> int:
    os.makedirs(a.root, exist_ok=True)
    want = a.parts.split(",")
    if not _alive(a.root) and any(not _done(a.root, n) for n in want):
        a.parts = a.all or a.parts
        start(a)
        a.parts = ",".join(want)
    t_end = time.monotonic() + a.wait
    while time.monotonic() < t_end and any(not _done(a.root, n) for n in want):
        time.sleep(2)
    for name in want:
        d = _done(a.root, name)
        folder = os.path.join(a.root, name)
        tag = "" if d else "-partial"
        if os.path.isdir(folder):
            with tarfile.open(os.path.join(a.out, f"{name}{tag}.tar.gz"), "w:gz") as t:
                t.add(folder, arcname=name, filter=_skip)
        print(f"==== {name}: {d or 'still running'}")
        log = os.path.join(folder, "log.txt")
        if os.path.exists(log):
            lines = open(log, errors="replace").read().splitlines()
            print("\n".join(lines[-a.tail:]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("verb", choices=("start", "run", "collect"))
    ap.add_argument("--parts", required=True)
    ap.add_argument("--all", default=None, help="collect: the parts to (re)start if no runner is alive")
    ap.add_argument("--workers", default="1,2,4", help="GPU counts, smallest first")
    ap.add_argument("--root", default="/tmp/device-suite")
    ap.add_argument("--wait", type=float, default=540)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/device-suite-out"))
    ap.add_argument("--tail", type=int, default=40)
    a = ap.parse_args(argv)
    return {"start": start, "run": run_parts, "collect": collect}[a.verb](a)


if __name__ == "__main__":
    sys.exit(main())
