"""The stream analysis of a traced step against hand-computed values, and the trace reader
against a trace that torch.profiler writes on the CPU."""
import gzip
import json

import pytest
import torch

from shmlearn.bench.timeline import analyze, intersect, kernels_of_trace, union


def k(name, ts, dur, stream):
    return {"name": name, "ts": ts, "dur": dur, "stream": stream}


def test_union_and_intersect():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6), (7, 9)]) == [(2, 3), (5, 6), (7, 8)]


def test_two_steps_split_by_hand():
    # step 1 on [0, 50), step 2 on [50, 100); main stream 7 (more kernels), side stream 9
    ks = []
    for o in (0, 50):
        ks += [k("fwd", o + 0, 10, 7), k("bwd", o + 12, 10, 7),  # gap 2 us: idle
               k("upd", o + 30, 5, 7),                            # gap 8 us: side covers 5 of it
               k("wgrad", o + 20, 7, 9),                          # 2 beside main, 5 alone
               k("tail", o + 40, 10, 9)]                          # alone, main idle after its last kernel
    a = analyze(ks, steps=2)
    assert a["main_stream"] == "7" and a["kernels_per_step"] == 5 and a["main_kernels_per_step"] == 3
    assert a["span_us_per_step"] == 50
    assert a["main_busy_us"] == 25 and a["side_busy_us"] == 17
    assert a["overlap_us"] == 2 and a["side_only_us"] == 15
    # nothing runs on [10,12), [27,30) and [35,40) of each step (the tail fills [40,50))
    assert a["idle_us"] == 10
    # main gaps per step: 2 (none covered) and 8 (5 covered), plus 15 between steps (10 covered)
    assert a["main_gaps"] == 2.5 and a["main_gap_us"] == (2 + 8 + 2 + 8 + 15) / 2
    assert a["main_gap_covered_us"] == (5 + 5 + 10) / 2
    assert [b["count"] for b in a["gap_buckets"]] == [0, 1, 0, 1.5, 0]  # 2 in (1,2]; 8, 15 in (5,20]
    top = a["largest_gaps"][0]
    assert top["us"] == 15 and top["name_before"] == "upd" and top["name_after"] == "fwd"


def test_overlapping_main_kernels_make_no_gap():
    # a kernel that ends inside a longer one before it leaves no gap behind
    a = analyze([k("a", 0, 10, 1), k("b", 2, 3, 1), k("c", 10, 1, 1)])
    assert a["main_gaps"] == 0 and a["main_busy_us"] == 11


def test_no_kernels_is_an_error():
    with pytest.raises(ValueError, match="no kernel"):
        analyze([])


def test_reader_takes_kernels_and_leaves_cpu_events(tmp_path):
    doc = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 10.5, "dur": 4.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 15.0, "dur": 1.0, "args": {"stream": 9}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 30.0, "args": {}},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 2.0}]}
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(doc, f)
    assert kernels_of_trace(str(p)) == [
        {"name": "sm90_gemm", "ts": 10.5, "dur": 4.0, "stream": 7},
        {"name": "Memset (Device)", "ts": 15.0, "dur": 1.0, "stream": 9}]


def test_reader_reads_what_the_profiler_exports(tmp_path):
    # on the CPU the profiler writes no kernels: the reader must parse its file and find none
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    p = str(tmp_path / "cpu.json")
    prof.export_chrome_trace(p)
    assert kernels_of_trace(p) == []
