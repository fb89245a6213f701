"""The stream analysis of a traced step against hand-computed values, and the trace reader
against a trace that torch.profiler writes on the CPU."""
import gzip
import json

import pytest
import torch

from shmlearn.bench.timeline import analyze, intersect, kernel_class, kernels_of_trace, phases, union


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


def test_phases_cut_each_step_at_its_loss_by_hand():
    # two replays of [conv 0-10, red 11-14, log_softmax 15-16, dgrad 17-27 | wgrad 20-30 on
    # another stream, sgd 31-33]: forward [0, 15), the rest [15, 33) of each step
    ks = []
    for o in (0, 100):
        ks += [k("sm90_xmma_fprop", o, 10, 7), k("triton_red_fused_bn", o + 11, 3, 7),
               k("triton_per_fused__log_softmax_1", o + 15, 1, 7), k("sm90_xmma_dgrad", o + 17, 10, 7),
               k("sm90_xmma_wgrad", o + 20, 10, 9), k("_sgd_kernel", o + 31, 2, 9)]
    p = phases(ks, steps=2)
    f, b = p["forward"], p["backward"]
    assert f["wall_us"] == 15 and f["busy_us"] == 13 and f["kernels"] == 2 and f["kernel_us"] == 13
    assert f["by_class_us"] == {"conv/matmul": 10, "reduction": 3}
    # [15, 33): busy 15-16, 17-30, 31-33 = 16 us; kernels 1 + 10 + 10 + 2 = 23 us (streams overlapped)
    assert b["wall_us"] == 18 and b["busy_us"] == 16 and b["kernels"] == 4 and b["kernel_us"] == 23
    assert b["by_class_us"] == {"reduction": 1, "conv/matmul": 20, "update": 2}


def test_phases_refuse_what_is_not_replays_of_a_step():
    one = [k("sm90_xmma_fprop", 0, 10, 7), k("triton_per_fused__log_softmax_1", 11, 1, 7)]
    with pytest.raises(ValueError, match="3 kernels are not 2 replays"):
        phases(one + [k("x", 20, 1, 7)], steps=2)
    with pytest.raises(ValueError, match="step 0 has no kernel named like"):
        phases([k("sm90_xmma_fprop", 0, 10, 7), k("triton_poi_fused_relu", 11, 1, 7)], steps=1)


def test_kernel_classes():
    # Inductor's names list what they fused, convolution backwards included: their prefix decides
    assert kernel_class("triton_poi_fused__native_batch_norm_legit_functional_conv2d_backward_overlap_7") == "pointwise"
    assert kernel_class("triton_red_fused__native_batch_norm_legit_functional_12") == "reduction"
    assert kernel_class("sm90_xmma_wgrad_indexed_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc") == "conv/matmul"
    assert kernel_class("nvjet_sm90_tst_64x32_64x16_1x2_h_bz_splitK_NTT") == "conv/matmul"
    assert kernel_class("_sgd_kernel") == "update"
    assert kernel_class("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...Copy<float, float>>") == "update"
    assert kernel_class("Memset (Device)") == "fill/copy"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>") == "fill/copy"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<2, CUDAFunctorOnSelf_add<long>>") == "pointwise"
    assert kernel_class("shm_fill") == "fill/copy" and kernel_class("mystery") == "other"


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


def test_main_on_a_saved_trace(tmp_path, capsys):
    from shmlearn.cli.main import main
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": float(t), "dur": 1.0, "args": {"stream": 7}}
              for n, t in (("sm90_xmma_fprop", 0), ("triton_per_fused__log_softmax_0", 2), ("sm90_xmma_dgrad", 4))]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": events}))
    assert main(["bench", "timeline", str(p), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "traced 1 steps" in out and "forward: 2.0 us" in out and "backward: 3.0 us" in out
    assert main(["bench", "timeline", str(p), "--steps", "2"]) == 2  # 3 kernels are not 2 replays: one line, exit 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 kernels are not 2 replays of one step" in err[0]
