"""Memset nodes made kernel nodes: the fill's arguments against the memset's bytes (CPU), the
PTX against NVIDIA's assembler where one is installed, and on a GPU the edited graph against the
same memsets replayed unedited."""
import ctypes
import glob
import os
import shutil
import subprocess

import pytest
import torch

from shmlearn.step import graph_memsets as gm


def memset_bytes(size, dst, pitch, value, esize, width, height):
    """What cuMemsetD2D{8,16,32} writes into a zeroed buffer of `size` bytes (dst: offset)."""
    buf = bytearray(size)
    v = (value & ((1 << (8 * esize)) - 1)).to_bytes(esize, "little")
    for r in range(height):
        for c in range(width):
            a = dst + r * pitch + c * esize
            buf[a:a + esize] = v
    return bytes(buf)


def fill_bytes(size, args):
    """What the PTX kernel writes with (dst, pitch, value, esize, width, height)."""
    dst, pitch, value, esize, width, height = args
    return memset_bytes(size, dst, pitch, value, esize, width, height)


@pytest.mark.parametrize("dst,pitch,value,esize,width,height", [
    (0, 0, 0, 1, 64, 1),            # aligned bytes: one word fill of the byte
    (0, 0, 0xAB, 1, 64, 1),
    (1, 0, 0xAB, 1, 64, 1),         # unaligned start: stays a byte fill
    (0, 0, 0xCD, 1, 63, 1),         # odd length: stays a byte fill
    (2, 0, 0x12, 1, 62, 1),         # two-byte aligned, even: becomes a 16-bit fill
    (0, 0, 0xBEEF, 2, 30, 1),
    (2, 0, 0xBEEF, 2, 30, 1),
    (0, 0, 0xDEADBEEF, 4, 16, 1),
    (0, 96, 0x7F, 1, 40, 3),        # 2-D, word-aligned pitch
    (0, 90, 0x7F, 1, 40, 3),        # 2-D, pitch 90: not a multiple of 4, a 16-bit fill at most
    (0, 64, 0x1FF, 1, 8, 2),        # a value wider than the element is cut to it, as CUDA does
])
def test_fill_writes_the_memsets_bytes(dst, pitch, value, esize, width, height):
    p = gm.MemsetParams(dst=dst, pitch=pitch, value=value, elementSize=esize, width=width, height=height)
    args = gm.fill_args(p)
    size = dst + max(pitch, width * esize) * height + 8
    assert fill_bytes(size, args) == memset_bytes(size, dst, pitch, value, esize, width, height)


def test_fill_widens_aligned_byte_fills():
    args = gm.fill_args(gm.MemsetParams(dst=256, pitch=0, value=0x5A, elementSize=1, width=4096, height=1))
    assert args == (256, 0, 0x5A5A5A5A, 4, 1024, 1)
    with pytest.raises(ValueError, match="element size 3"):
        gm.fill_args(gm.MemsetParams(dst=0, pitch=0, value=0, elementSize=3, width=4, height=1))


def _ptxas():
    import triton
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
    return shutil.which("ptxas") or (found[0] if found else None)


def test_ptx_assembles_for_hopper(tmp_path):
    try:
        ptxas = _ptxas()
    except ImportError:
        ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas here (CUDA toolkit or Triton)")
    src = tmp_path / "fill.ptx"
    src.write_text(gm.PTX)
    r = subprocess.run([ptxas, "-arch=sm_90", str(src), "-o", str(tmp_path / "fill.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fill.cubin").stat().st_size > 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _node_types(raw):
    d = gm._get_driver()
    out = []
    for n in d.nodes(d.cu.cuGraphGetNodes, ctypes.c_void_p(raw), "cuGraphGetNodes"):
        k = ctypes.c_int()
        d.check(d.cu.cuGraphNodeGetType(ctypes.c_void_p(n), ctypes.byref(k)), "cuGraphNodeGetType")
        out.append(k.value)
    return out


@cuda
def test_edited_graph_writes_what_the_memsets_wrote():
    cu = ctypes.CDLL("libcuda.so.1")
    buf = torch.zeros(1 << 18, dtype=torch.uint8, device="cuda")
    base = buf.data_ptr()
    fills = [  # (offset, value, esize, width, height, pitch): 8/16/32-bit, 1-D and 2-D, odd sizes
        (0, 0x11, 1, 4096, 1, 0), (4099, 0x22, 1, 13, 1, 0), (8192, 0x3344, 2, 1000, 1, 0),
        (12288, 0x55667788, 4, 777, 1, 0), (20480, 0x99, 1, 40, 5, 100), (24576, 0xAABB, 2, 9, 4, 64),
        (65536, 0x42, 1, gm.MAX_BYTES + 1, 1, 0)]  # too large: stays a memset node

    def record(stream):
        h = ctypes.c_void_p(stream.cuda_stream)
        for off, v, es, w, hgt, pitch in fills:
            dst = ctypes.c_uint64(base + off)
            if hgt == 1:
                fn = {1: cu.cuMemsetD8Async, 2: cu.cuMemsetD16Async, 4: cu.cuMemsetD32Async}[es]
                assert fn(dst, {1: ctypes.c_ubyte, 2: ctypes.c_ushort, 4: ctypes.c_uint}[es](v),
                          ctypes.c_size_t(w), h) == 0
            else:
                fn = {1: cu.cuMemsetD2D8Async, 2: cu.cuMemsetD2D16Async, 4: cu.cuMemsetD2D32Async}[es]
                assert fn(dst, ctypes.c_size_t(pitch), {1: ctypes.c_ubyte, 2: ctypes.c_ushort, 4: ctypes.c_uint}[es](v),
                          ctypes.c_size_t(w), ctypes.c_size_t(hgt), h) == 0
        buf.add_(1)  # a kernel after the memsets: the new nodes must come before it

    results = []
    for edit in (False, True):
        buf.zero_()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        s = torch.cuda.Stream()
        with torch.cuda.graph(g, stream=s):
            record(torch.cuda.current_stream())
        raw = g.raw_cuda_graph()
        before = _node_types(raw)
        if edit:
            sizes = gm.memsets_to_kernels(raw, torch.cuda.current_device())
            assert before.count(2) == len(fills) and len(sizes) == len(fills) - 1
            assert sorted(sizes) == sorted(es * w * h for _, _, es, w, h, _ in fills[:-1])
            assert _node_types(raw).count(2) == 1
        g.instantiate()
        buf.zero_()
        g.replay()
        torch.cuda.synchronize()
        results.append(buf.clone())
    assert torch.equal(results[0], results[1])
    assert int(results[1][0]) == 0x12 and int(results[1][4099]) == 0x23  # the fill, then the +1
    assert int(results[1][65536 + gm.MAX_BYTES]) == 0x43


@cuda
def test_step_trains_the_same_weights_with_memsets_made_kernels():
    """The fast step of a small ResNet (eager kernels in the graph), 6 steps with the memset
    nodes kept and made kernels: the same weights, bit for bit (cuDNN deterministic, as in
    benchmarks/step_agreement.py, which this reuses)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import torch.distributed as dist
    from step_agreement import train
    from shmlearn.bench.throughput import ThroughputConfig
    from shmlearn.launch.start import free_port
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    c = ThroughputConfig(model="resnet18", input_shape=[3, 32, 32], device="cuda", batch_sizes=[32],
                         precision="bf16", channels_last=True, check_every=3, samples=32 * 6)
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        kept, _, row_kept = train(c, "allreduce:memset-nodes", torch.device("cuda", 0), 32, 6)
        made, _, row_made = train(c, "allreduce", torch.device("cuda", 0), 32, 6)
    finally:
        torch.backends.cudnn.deterministic = before
    assert row_kept["mode"] == row_made["mode"] == "cuda-graph"
    assert row_kept["memsets_replaced"] == 0
    assert torch.equal(kept, made)
