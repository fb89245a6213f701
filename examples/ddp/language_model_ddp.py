"""pytorch/examples' word_language_model, its Transformer, as a DDP script written as a careful user
would: the reference the shmlearn port (examples/language_model.py) is held to (docs/ports.md,
tests/test_ports.py, benchmarks/ports.py).

    torchrun --standalone --nproc-per-node 2 examples/ddp/language_model_ddp.py [--epochs N | --samples N]

What it shares with the port: model.py's TransformerModel and data.py's Corpus (upstream's files,
unchanged, in examples/word_language_model/), the corpus (docs_corpus.build(): this checkout's docs),
the original's flags and defaults (emsize 200, nhid 200, 2 layers, 2 heads, dropout 0.2, bptt 35,
--batch_size 20 sequences a rank a step, lr 20, clip 0.25, seed 1111), its criterion (NLLLoss on the
(T, B, V) output), its update (plain SGD, p -= lr * grad; AdamW with --use-optimizer) and its
evaluate() (eval batch 10, on the token streams as batchify lays them out), and the budget.
What a DDP user adds: Gloo (the CPU); the training stream cut into bptt windows
(docs_corpus.windows, as the port's Dataset) drawn by a DistributedSampler (shuffled by --seed,
set_epoch each epoch, drop_last: every rank takes the same steps); clipping the gradient's global
norm after DDP has averaged it. Like the port (one shmlearn run for the whole budget), the learning
rate stays constant: the original's divide-by-4 when the validation loss stalls is not applied.

Budget: --epochs passes over the training windows, or --samples windows of all ranks together
(steps = samples // (ranks x batch size)), as shmlearn counts them.
Rank 0 prints the validation loss, the original's end-of-training line (test loss, test ppl), the
loss over the port's test windows (as shmlearn's summary.json test_loss), then
`time to first step` (from this process's start to the end of the first optimizer step), `first
step ended at unix T` (for benchmarks/ports.py) and the training seconds.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/
from vae_ddp import process_start_unix  # noqa: E402 - the same clock as the VAE's reference
from word_language_model import data, docs_corpus  # noqa: E402 - upstream's data.py; the corpus
from word_language_model.model import TransformerModel  # noqa: E402 - upstream's model.py


def batchify(data, bsz):  # main.py's
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def evaluate(model, data_source, ntokens, bptt, criterion):  # main.py's evaluate(), Transformer branch
    model.eval()
    total_loss = 0.
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, bptt):
            seq_len = min(bptt, len(data_source) - 1 - i)
            data, targets = data_source[i:i+seq_len], data_source[i+1:i+1+seq_len].view(-1)
            output = model(data).view(-1, ntokens)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)



def windows_loss(model, windows, ntokens, criterion):
    """The mean loss a window over the port's test windows, as shmlearn's evaluation reports it
    (summary.json test_loss): the windows' own contexts, not batchify's columns."""
    model.eval()
    total = 0.
    with torch.no_grad():
        for x, y in DataLoader(windows, batch_size=1024):
            output = model(x.t()).view(-1, ntokens)
            total += len(x) * criterion(output, y.t().reshape(-1)).item()
    return total / len(windows)


def main():
    parser = argparse.ArgumentParser(description="word_language_model's Transformer with DDP (torchrun, Gloo)")
    parser.add_argument('--data', type=str, default=None, help='corpus folder (default: docs_corpus.build())')
    parser.add_argument('--emsize', type=int, default=200)
    parser.add_argument('--nhid', type=int, default=200)
    parser.add_argument('--nlayers', type=int, default=2)
    parser.add_argument('--lr', type=float, default=20)
    parser.add_argument('--clip', type=float, default=0.25)
    parser.add_argument('--epochs', type=float, default=None, help='passes over the training windows (default: 40)')
    parser.add_argument('--samples', type=int, default=None, help='instead of --epochs: windows of all ranks together')
    parser.add_argument('--batch_size', type=int, default=20, help='windows a rank a step')
    parser.add_argument('--bptt', type=int, default=35)
    parser.add_argument('--dropout', type=float, default=0.2)
    parser.add_argument('--seed', type=int, default=1111)
    parser.add_argument('--nhead', type=int, default=2)
    parser.add_argument('--use-optimizer', action='store_true', help='AdamW instead of plain SGD')
    args = parser.parse_args()
    if args.epochs is not None and args.samples is not None:
        parser.error("--epochs and --samples: give one budget")
    started = process_start_unix()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    corpus = data.Corpus(args.data or docs_corpus.build())
    train_set = docs_corpus.windows(corpus.train, args.bptt)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    # shmlearn's budget: epochs x the training set's size, in samples, over (ranks x batch) a step; a
    # remainder of steps past the last full epoch runs into the next one.
    samples = args.samples if args.samples is not None else int((40 if args.epochs is None else args.epochs) * len(train_set))
    steps = samples // (world * args.batch_size)
    if steps < 1:
        parser.error(f"the budget gives no step of {world} x {args.batch_size} windows")

    ntokens = len(corpus.dictionary)
    # broadcast_buffers=False: the one buffer, PositionalEncoding's constant `pe`, is a transposed view that
    # DDP's per-forward buffer broadcast refuses ("some elements ... refer to a single memory location").
    model = DDP(TransformerModel(ntokens, args.emsize, args.nhead, args.nhid, args.nlayers, args.dropout),
                broadcast_buffers=False)
    criterion = nn.NLLLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr) if args.use_optimizer else None
    first_step = None
    t_train = time.perf_counter()
    step, epoch = 0, 0
    model.train()
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            model.zero_grad()
            output = model(x.t()).view(-1, ntokens)  # the original's layout: (T, B) in, (T, B, V) out
            loss = criterion(output, y.t().reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            if optimizer is not None:
                optimizer.step()
            else:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-args.lr)
            step += 1
            if first_step is None:
                first_step = time.time()
            if step == steps:
                break
        epoch += 1
    train_s = time.perf_counter() - t_train

    if rank == 0:
        val_loss = evaluate(model.module, batchify(corpus.valid, 10), ntokens, args.bptt, criterion)
        test_loss = evaluate(model.module, batchify(corpus.test, 10), ntokens, args.bptt, criterion)
        print('| valid loss {:5.2f} | valid ppl {:8.2f}'.format(val_loss, math.exp(val_loss)))
        print('=' * 89)
        print('| End of training | test loss {:5.2f} | test ppl {:8.2f}'.format(test_loss, math.exp(test_loss)))
        print('=' * 89)
        windows = windows_loss(model.module, docs_corpus.windows(corpus.test, args.bptt), ntokens, criterion)
        print(f"windows test loss {windows:.4f} (ppl {math.exp(windows):.2f})")
        print(f"time to first step: {first_step - started:.2f} s (from this process's start)")
        print(f"first step ended at unix {first_step:.3f}")
        print(f"training: {steps} steps of {world} x {args.batch_size} windows in {train_s:.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: with torch 2.13 and Gloo, a rank's exit after
    # destroy_process_group() aborted ("terminate called without an active exception") or hung in
    # the group's destructors, seen in CI; everything is printed and the group is gone by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
