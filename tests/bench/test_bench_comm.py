"""bench comm on a real 2-process Gloo group: every op and size asked is in the JSON, with sane numbers."""
import json
import time

import pytest

from shmlearn.bench.comm import BUS_FACTOR, OPS, default_sizes
from shmlearn.bench.common import parse_int_list, parse_size, stats
from shmlearn.cli.main import main
from shmlearn.errors import BadInput


def test_sizes_and_lists():
    assert parse_size("4K") == 4096 and parse_size("256M") == 256 << 20 and parse_size("100") == 100
    assert default_sizes() == [4096 * 4 ** i for i in range(9)]  # 4 KB .. 256 MB
    assert default_sizes(4096, 16384, 2) == [4096, 8192, 16384]
    assert parse_int_list("1-3,8", flag="--workers") == [1, 2, 3, 8]
    with pytest.raises(BadInput, match="--sizes 4Q"):
        parse_size("4Q")
    s = stats([3.0, 1.0, 2.0, 4.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0 and s["n"] == 4


def test_bus_factors_follow_nccl_tests():
    f = {op: fn(4) for op, (_, fn) in BUS_FACTOR.items()}
    assert f == {"all_reduce": 1.5, "reduce_scatter": 0.75, "all_gather": 0.75, "gather": 0.75,
                 "broadcast": 1.0, "reduce": 1.0}


def test_bench_comm_gloo_two_processes(tmp_path, capsys):
    out = tmp_path / "comm.json"
    sizes = ["4K", "64K"]
    rc = main(["bench", "comm", "--backend", "gloo", "--workers", "2", "--sizes", ",".join(sizes),
               "--warmup", "1", "--iters", "3", "--min-iters", "3", "--out", str(out), "--no-plot"])
    assert rc == 0
    doc = json.loads(out.read_text())
    for key in ("device", "driver", "torch_version", "backend", "date", "cpu_count"):
        assert key in doc["env"]
    assert doc["env"]["backend"] == "gloo"
    got = {(r["op"], r["world_size"], r["bytes"]) for r in doc["results"]}
    assert got == {(op, 2, parse_size(s)) for op in OPS for s in sizes}
    for r in doc["results"]:
        t = r["time_s"]
        assert r["iters"] == t["n"] == 3
        assert 0 < t["min"] <= t["p25"] <= t["median"] <= t["p75"] <= t["max"] < 10
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / t["median"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * BUS_FACTOR[r["op"]][1](2))
    assert "all_reduce" in capsys.readouterr().out


def test_bench_comm_bad_input_exits_2(tmp_path, capsys):
    assert main(["bench", "comm", "--ops", "alltoall", "--out", str(tmp_path / "x.json")]) == 2
    assert "--ops alltoall" in capsys.readouterr().err
    assert main(["bench", "comm", "--backend", "nccl", "--workers", "64", "--out", str(tmp_path / "x.json")]) == 2


def test_bench_comm_compute_ms_computes_before_each_call_and_times_only_the_call(tmp_path):
    out = tmp_path / "after.json"
    t0 = time.perf_counter()
    rc = main(["bench", "comm", "--backend", "gloo", "--workers", "2", "--ops", "all_reduce", "--sizes", "4K",
               "--warmup", "1", "--iters", "4", "--min-iters", "4", "--compute-ms", "40", "--out", str(out),
               "--no-plot"])
    wall = time.perf_counter() - t0
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["compute_ms"] == 40.0  # simulate --comm-after-compute reads it
    (r,) = doc["results"]
    assert wall >= 5 * 0.040  # 1 warm-up + 4 timed calls, each after 40 ms of compute
    assert r["time_s"]["median"] < 0.040  # the compute is not in the call's time


def test_bench_comm_compute_ms_out_of_range_exits_2(tmp_path, capsys):
    assert main(["bench", "comm", "--compute-ms", "-1", "--out", str(tmp_path / "x.json")]) == 2
    assert "--compute-ms -1" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


# --- the shared-memory path (bench/comm.py's module docstring; sync/shm.py) --------------------

def _bench(tmp_path, *args, name="comm.json"):
    out = tmp_path / name
    rc = main(["bench", "comm", "--warmup", "1", "--iters", "3", "--min-iters", "3", "--budget-s", "0.1",
               "--out", str(out), "--no-plot", *args])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_comm_times_the_shared_memory_collectives_a_cpu_run_uses(tmp_path, capsys):
    doc = _bench(tmp_path, "--workers", "2", "--ops", "all_reduce,gather,broadcast,reduce", "--sizes", "4K,64K")
    assert doc["env"]["collectives"] == "shared-memory" and doc["config"]["shared_memory"] == "auto"
    assert doc["notes"] == []
    paths = {(r["op"], r["bytes"]): r["collectives"] for r in doc["results"]}
    assert paths == {(op, parse_size(s)): "shared-memory" if op != "reduce" else "gloo"  # no run reduces
                     for op in ("all_reduce", "gather", "broadcast", "reduce") for s in ("4K", "64K")}
    for r in doc["results"]:
        t = r["time_s"]
        assert r["world_size"] == 2 and t["n"] == 3 and 0 < t["min"] <= t["median"] <= t["max"] < 10
    assert "shared-memory" in capsys.readouterr().out


def test_bench_comm_shared_memory_off_is_gloo_and_repeats_keep_the_median_sweep(tmp_path):
    doc = _bench(tmp_path, "--workers", "2", "--ops", "all_reduce,gather", "--sizes", "4K", "--shared-memory", "off",
                 "--repeats", "3")
    assert doc["env"]["collectives"] == "gloo" and doc["config"]["shared_memory"] == "off"
    assert {r["collectives"] for r in doc["results"]} == {"gloo"} and len(doc["results"]) == 2
    for r in doc["results"]:
        assert len(r["sweep_medians_s"]) == 3 and r["time_s"]["median"] == sorted(r["sweep_medians_s"])[1]


def test_bench_comm_one_rank_falls_back_to_gloo_with_a_note(tmp_path):
    doc = _bench(tmp_path, "--workers", "1", "--ops", "all_reduce", "--sizes", "4K")
    assert doc["env"]["collectives"] == "gloo"
    assert [r["collectives"] for r in doc["results"]] == ["gloo"]
    assert len(doc["notes"]) == 1 and "W=1: Gloo, not shared memory: 1 rank" in doc["notes"][0]


def test_sizes_above_the_mapping_are_gloo_as_in_a_run():
    from shmlearn.bench.comm import rank_bytes, shm_capacity
    from shmlearn.sync.shm import MAX_BYTES
    big = 256 << 20
    assert rank_bytes("gather", big, 4, 4) == big // 4 and rank_bytes("all_reduce", big, 4, 4) == big
    assert shm_capacity(["all_reduce"], [4096, big], 4, 4) == big  # 2 x 4 x 256 MB = 2 GiB fits
    assert 2 * 9 * big > MAX_BYTES
    assert shm_capacity(["all_reduce"], [4096, big], 9, 4) == 1017 * 4  # 4.5 GiB does not: Gloo's
    assert shm_capacity(["gather", "all_reduce"], [big], 9, 4) == rank_bytes("gather", big, 9, 4) == big // 4 // 9 * 4
    assert shm_capacity(["reduce", "all_gather"], [4096], 2, 4) == 0  # no run takes these through it


def _averages(env, sizes):
    """Each rank: the bench's shared-memory calls, in the order it makes them (a sum, then ps's
    gather and broadcast), checked against Gloo's collectives they stand for."""
    import torch
    import torch.distributed as dist
    from shmlearn.bench.comm import CommConfig, _open_shm, _shm_call, rank_bytes
    rank, world = env.rank, env.world_size
    c = CommConfig(ops=["all_reduce", "gather", "broadcast"], sizes=sizes)
    comm, capacity, why = _open_shm(c, world, rank, 4)
    assert comm is not None and why is None and capacity == rank_bytes("all_reduce", max(sizes), world, 4)
    out = []
    for n in (rank_bytes("all_reduce", s, world, 4) // 4 for s in sizes):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank + 10 * n))
        ref = x.clone()
        dist.all_reduce(ref)
        b = {"buf": x.clone()}
        _shm_call("all_reduce", b, comm, world)
        out.append(torch.equal(b["buf"], ref / world) if world == 2 else torch.allclose(b["buf"], ref / world))
        rows = comm.gather(x)
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x)
        out.append(rows is None if rank else torch.equal(rows, torch.stack(every)))
        b = {"buf": x.clone()}
        _shm_call("broadcast", b, comm, world)
        out.append(torch.equal(b["buf"], every[0]))
    comm.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_shared_memory_calls_average_and_broadcast_as_gloo_does(world):
    from shmlearn.bench.common import RANK_TIMEOUT_S
    from shmlearn.launch.pool import run_local
    res = run_local(_averages, ([4096, 65536],), world, cuda=False, timeout_s=RANK_TIMEOUT_S)
    assert all(all(r) for r in res) and len(res[0]) == 6


def test_bench_comm_shared_memory_at_three_ranks_moves_from_op_to_op(tmp_path):
    # The protocol refuses (never races) a sequence that would overwrite unread slots: every op
    # after every other, at W=3, must be one it allows (the module docstring's order).
    doc = _bench(tmp_path, "--workers", "3", "--ops", "broadcast,all_reduce,gather", "--sizes", "4K,16K")
    assert len(doc["results"]) == 6 and {r["collectives"] for r in doc["results"]} == {"shared-memory"}
