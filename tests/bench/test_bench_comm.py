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
