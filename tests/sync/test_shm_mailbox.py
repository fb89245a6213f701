"""sync/shm_mailbox.py: async-ps's messages through shared memory, on real Gloo groups of forked
processes: the server takes pushes from any worker in arrival order (not rank order), each with
its payload and version, and answers each worker in its own row; a dead or silent peer is named
within seconds or the --timeout, and nothing is left in /dev/shm. Then async-ps itself: trained
through the mailbox and through Gloo (--shared-memory off), the same bits at staleness 0; with
S >= 1 every lag within S; and where the mailbox cannot be made, every rank on Gloo with the reason."""
import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

from shmlearn.launch.start import free_port
from shmlearn.sync import shm
from shmlearn.sync.shm_mailbox import PUSH, REPLY, open_mailbox
from procs import left_since, note_error_and_leave, processes

N = 1000  # values in a push (a reply has N - 1: the gradient's control slot)
ROUNDS = 8


def _join(rank, world, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _left() -> set:
    return set(glob.glob(os.path.join(shm._folder(), "shmlearn-allreduce-*")))


def _payload(rank, i):
    return torch.arange(N, dtype=torch.float32) * (rank + 1) + i


def _exchange(rank, world, port, out):
    """Round 0, a chain the server drives: worker W pushes first, then each worker r < W pushes
    only once the server has taken r + 1's (its "go" reply): arrival order W, W-1, ..., 1. Then
    ROUNDS pushes each, free running (one worker sleeps between them): each reply carries the
    count of pushes the server has taken, each push its sender's round as its version."""
    _join(rank, world, port)
    box, why = open_mailbox(N, N - 1, torch.float32, rank, world, None, timeout_s=60)
    assert why is None and box is not None, why
    if rank == 0:
        order, taken = [], 0
        for r in range(world - 1, 0, -1):
            if r < world - 1:
                box.slot(REPLY, r, N - 1, torch.float32).fill_(-1.0)  # go
                box.post(r)
            src = box.take([r])
            order.append(src)
            assert torch.equal(box.slot(PUSH, src, N, torch.float32)[:-1], _payload(src, 0)[:-1])
            taken += 1
        for src in order:  # answer round 0: every worker free runs from here
            box.slot(REPLY, src, N - 1, torch.float32).fill_(float(taken))
            box.post(src)
        seen = []
        for _ in range((world - 1) * ROUNDS):
            src = box.take(range(1, world))
            push = box.slot(PUSH, src, N, torch.float32)
            i = int(push[-1].item())
            ok = torch.equal(push[:-1], _payload(src, i)[:-1])
            taken += 1
            seen.append((src, i, ok))
            box.slot(REPLY, src, N - 1, torch.float32).fill_(float(taken))
            box.post(src)
        torch.save({"order": order, "seen": seen}, os.path.join(out, "server.pt"))
    else:
        push, reply = box.slot(PUSH, rank, N, torch.float32), box.slot(REPLY, rank, N - 1, torch.float32)
        if rank < world - 1:
            box.wait_for(0)  # go
            assert reply[0].item() == -1.0
        replies = []
        for i in range(ROUNDS + 1):
            push.copy_(_payload(rank, i))
            push[-1] = i  # the version
            box.post(0)
            box.wait_for(0)
            replies.append(reply[0].item())
            assert torch.equal(reply, torch.full((N - 1,), replies[-1]))
            if rank == 1:
                time.sleep(0.01)  # a slower worker: the others' pushes overtake its
        torch.save(replies, os.path.join(out, f"rank{rank}.pt"))
    box.close()
    dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("world", [2, 4])
def test_the_server_takes_pushes_in_arrival_order_with_their_versions(tmp_path, world):
    before = _left()
    processes(_exchange, (world, free_port(), str(tmp_path)), world)
    server = torch.load(tmp_path / "server.pt")
    assert server["order"] == list(range(world - 1, 0, -1))  # arrival order, not rank order
    seen = server["seen"]
    assert all(ok for _, _, ok in seen)  # every push read whole, as its worker wrote it
    for r in range(1, world):
        assert [i for src, i, _ in seen if src == r] == list(range(1, ROUNDS + 1))  # its versions, in order
        replies = torch.load(tmp_path / f"rank{r}.pt")
        assert replies == sorted(replies) and len(set(replies)) == len(replies)  # each its own answer
        assert replies[-1] <= (world - 1) * (ROUNDS + 1)
    assert not left_since(before, os.path.join(shm._folder(), "shmlearn-allreduce-*"))  # unlinked at setup: nothing left


def _dies(rank, world, port, out, who, how):
    """One exchange, then `who` goes (exits without a word, or stays silent: `how`); the others
    wait for it (the server in take, a worker for its reply)."""
    _join(rank, world, port)
    box, why = open_mailbox(N, N, torch.float32, rank, world, None, timeout_s=3 if how == "silent" else 120)
    assert why is None, why
    if rank == 0:
        for _ in range(world - 1):
            box.post(box.take(range(1, world)))
    else:
        box.post(0)
        box.wait_for(0)
    if rank == who:
        if how == "exits":
            os._exit(0)  # gone without a word, as a killed rank
        waiting = [0] if who != 0 else list(range(1, world))
        t0 = time.monotonic()  # alive, silent (a hung rank) until the others have given up (3 s)
        done = [os.path.join(out, f"rank{r}.txt") for r in waiting]
        while not all(map(os.path.exists, done)) and time.monotonic() - t0 < 90:
            time.sleep(0.1)
        os._exit(0)
    if rank != 0 and who != 0:
        os._exit(0)  # a bystander: the server waits for `who` alone
    note_error_and_leave(out, rank, lambda: box.take([who]) if rank == 0 else box.wait_for(0))


@pytest.mark.parametrize("who, how", [(2, "exits"), (0, "exits"), (1, "silent"), (0, "silent")])
def test_a_dead_or_silent_peer_is_named_not_waited_for(tmp_path, who, how):
    """A worker gone: the server names it within seconds (its --timeout is 120 s); the server gone:
    its workers name it; a worker or the server alive but silent (hung): named after the
    --timeout (3 s). (SHMLEARN_FAULT cannot stop the server, which computes nothing: its faults
    fire in a rank's compute; tests/sync/test_async_ps.py stops and kills workers.)"""
    before = _left()
    world = 3
    processes(_dies, (world, free_port(), str(tmp_path), who, how), world)
    waiting = [0] if who != 0 else [1, 2]
    for r in waiting:
        line, seconds = (tmp_path / f"rank{r}.txt").read_text().splitlines()
        assert line.startswith("shared-memory messages: "), line
        if how == "exits":
            assert f"rank {who} ended" in line, line
            assert float(seconds) < 30, seconds
        else:
            assert f"no word from rank {who} in 3 s (--timeout)" in line, line
            assert 2.5 < float(seconds) < 30, seconds
    assert not left_since(before, os.path.join(shm._folder(), "shmlearn-allreduce-*"))


def _train(tmp_path, name, **kw):
    from shmlearn import TrainConfig, train
    cfg = dict(model="mlp", dataset="digits", device="cpu", strategy="async-ps", workers=2, threads=1,
               samples=2 * 32 * 40, batch_size=32, eval_points=2, progress=False, out=str(tmp_path / name))
    return train(TrainConfig(**{**cfg, **kw}))


def test_async_ps_at_staleness_0_trains_through_shared_memory_as_through_gloo_to_the_bit(tmp_path):
    runs = {m: _train(tmp_path, m, staleness=0, shared_memory=m) for m in ("auto", "off")}
    auto, off = runs["auto"].summary, runs["off"].summary
    assert (auto["collectives"], off["collectives"]) == ("shared-memory", "gloo")
    assert auto["collectives_note"] is None and off["collectives_note"] is None
    assert auto["final_loss"] == off["final_loss"] and auto["test_accuracy"] == off["test_accuracy"]
    assert auto["staleness_histogram"] == off["staleness_histogram"] == {"1": {"0": 40}, "2": {"0": 40}}
    for a, b in zip(runs["auto"].model.state_dict().values(), runs["off"].model.state_dict().values()):
        assert torch.equal(a, b)


def test_async_ps_with_staleness_runs_through_shared_memory_within_its_bound(tmp_path):
    s = _train(tmp_path, "s2", staleness=2, workers=3, samples=3 * 32 * 60, eval_points=1).summary
    assert s["collectives"] == "shared-memory"
    lags = [int(k) for h in s["staleness_histogram"].values() for k, c in h.items() if c]
    assert max(lags) <= 2
    assert s["applied_gradients"] == 3 * 60 == sum(s["gradients_per_worker"].values())
    assert s["samples_seen"] == 3 * 32 * 60 and s["final_loss"] < 2.3


def _setup(rank, world, port, out, how):
    """async-ps's setup where shared memory cannot be used (another host, a full /dev/shm)."""
    from shmlearn.sync.async_ps import AsyncPS
    _join(rank, world, port)
    if how == "another host" and rank == 1:
        shm._host = lambda: "another-boot/another-host"
    if how.startswith("no room") and rank == 0:
        room = os.posix_fallocate
        calls = []

        def full(fd, offset, length):  # "no room for the messages": the collectives' file fits, theirs not
            calls.append(length)
            if how == "no room" or len(calls) > 1:
                raise OSError(28, "No space left on device")
            room(fd, offset, length)
        os.posix_fallocate = full
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    s = AsyncPS(rank=rank, world_size=world, staleness=1)
    s.shared_memory, s.timeout_s, s.run_steps = "auto", 60, 10
    s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{s.collectives_path}|{s._p2p is not None}|{s.comm_note}")
    s.close()
    dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("how, why", [("another host", "its ranks are not all on one host"),
                                      ("no room", "No space left on device"),
                                      ("no room for the messages", "No space left on device")])
def test_where_the_mailbox_cannot_be_made_every_rank_talks_over_gloo_and_says_why(tmp_path, how, why):
    before = _left()
    processes(_setup, (3, free_port(), str(tmp_path), how), 3)
    # where the fast step's read of the losses (sync/shm.py's collectives) could not run there either, it says so
    start = "messages run on" if how == "no room for the messages" else "messages and collectives run on"
    for r in range(3):
        path, p2p, note = (tmp_path / f"rank{r}.txt").read_text().split("|", 2)
        assert (path, p2p) == ("gloo", "True"), (r, path, p2p)
        assert note.startswith(f"{start} Gloo, not shared memory: ") and why in note, note
    assert not left_since(before, os.path.join(shm._folder(), "shmlearn-allreduce-*"))
