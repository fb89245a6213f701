"""Memset nodes of a captured CUDA graph turned into kernel nodes, before it is instantiated.

Some of cuDNN's convolution engines zero a small workspace with cudaMemsetAsync before their
kernel; captured, that is a memset node. Replayed, a memset node between two kernels costs far
more than its own work: the GPU idles before and after each one, many times the gap between two
kernels in a row, and ResNet-34's step at batch 128 has 23 of them on its critical path (the
profile, issue 18's ninth round: docs/performance.md, "Behind the code"). A
kernel node doing the same fill runs in the graph's kernel stream like its neighbours.

`memsets_to_kernels(graph)` replaces each small memset node (up to MAX_BYTES) of a cudaGraph_t
(torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph(), after capture_end and before
instantiate) with a kernel node of the same dependencies and dependents that writes the same
values: a fill kernel of our own, written in PTX and loaded through the driver (no compiler at
run time, no extension to build).
The node takes the priority of the kernel it feeds, so a high-priority capture stays one.
"""
from __future__ import annotations

import ctypes
import threading
from typing import List, Optional

PTX = r"""
.version 7.0
.target sm_70
.address_size 64

// dst[r * pitch + c * esize] = value (esize bytes: 1, 2 or 4) for r < height, c < width:
// cuMemsetD2D{8,16,32}'s semantics; one thread per element, grid-stride.
.visible .entry shm_fill(
    .param .u64 p_dst,
    .param .u64 p_pitch,
    .param .u32 p_value,
    .param .u32 p_esize,
    .param .u64 p_width,
    .param .u64 p_height
)
{
    .reg .pred %p<5>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_dst];
    ld.param.u64 %rd2, [p_pitch];
    ld.param.u32 %r1, [p_value];
    ld.param.u32 %r2, [p_esize];
    ld.param.u64 %rd3, [p_width];
    ld.param.u64 %rd4, [p_height];
    mul.lo.u64 %rd5, %rd3, %rd4;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mov.u32 %r6, %nctaid.x;
    mul.wide.u32 %rd6, %r3, %r4;
    cvt.u64.u32 %rd7, %r5;
    add.u64 %rd8, %rd6, %rd7;
    mul.wide.u32 %rd9, %r6, %r4;
    cvt.u64.u32 %rd10, %r2;
    setp.eq.u64 %p4, %rd4, 1;
LOOP:
    setp.ge.u64 %p1, %rd8, %rd5;
    @%p1 bra DONE;
    @%p4 bra ROW0;
    div.u64 %rd11, %rd8, %rd3;
    rem.u64 %rd12, %rd8, %rd3;
    mul.lo.u64 %rd13, %rd11, %rd2;
    bra ADDR;
ROW0:
    // one row (the usual memset): no 64-bit division per element
    mov.u64 %rd13, 0;
    mov.u64 %rd12, %rd8;
ADDR:
    mul.lo.u64 %rd14, %rd12, %rd10;
    add.u64 %rd15, %rd1, %rd13;
    add.u64 %rd15, %rd15, %rd14;
    setp.eq.u32 %p2, %r2, 4;
    @%p2 bra STORE4;
    setp.eq.u32 %p3, %r2, 2;
    @%p3 bra STORE2;
    st.global.u8 [%rd15], %r1;
    bra NEXT;
STORE2:
    st.global.u16 [%rd15], %r1;
    bra NEXT;
STORE4:
    st.global.u32 [%rd15], %r1;
NEXT:
    add.u64 %rd8, %rd8, %rd9;
    bra LOOP;
DONE:
    ret;
}
"""

_MEMSET = 2  # CU_GRAPH_NODE_TYPE_MEMSET
_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PRIORITY = 8  # CU_LAUNCH_ATTRIBUTE_PRIORITY
THREADS = 256
MAX_BLOCKS = 1024
MAX_BYTES = 64 << 10
"""Memsets larger than this stay memset nodes: theirs is bandwidth work, which the driver's
memset does at least as well, and a fill kernel of that size takes SMs from kernels running
beside it. Made kernels, ResNet-34's 23 small memsets per step (4 bytes at most) gained and
alexnet-small's one of 2.7 MB lost (docs/performance.md, "Behind the code")."""


class MemsetParams(ctypes.Structure):
    """CUDA_MEMSET_NODE_PARAMS."""
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint32),
                ("elementSize", ctypes.c_uint32), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class KernelParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuGraphAddKernelNode_v2; v1 is its first nine fields)."""
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class LaunchAttrValue(ctypes.Union):
    """CUlaunchAttributeValue: 64 bytes; priority is its first int."""
    _fields_ = [("priority", ctypes.c_int), ("pad", ctypes.c_char * 64)]


def fill_args(p: MemsetParams):
    """The fill kernel's (dst, pitch, value, esize, width, height) for memset params `p`, in the
    widest element the layout allows: a byte fill of aligned whole words becomes a word fill of
    the byte repeated, so large fills take a quarter of the threads."""
    dst, pitch, value, esize, width, height = p.dst, p.pitch, p.value, p.elementSize, p.width, p.height
    if esize not in (1, 2, 4):
        raise ValueError(f"memset node element size {esize}: CUDA allows 1, 2 or 4")
    value &= (1 << (8 * esize)) - 1
    wide = 2 * esize
    while esize < 4 and dst % wide == 0 and width % 2 == 0 and (height == 1 or pitch % wide == 0):
        value |= value << (8 * esize)
        width //= 2
        esize, wide = wide, 2 * wide
    return dst, pitch, value, esize, width, height


class _Driver:
    """The driver entry points this module calls, and the fill kernel, loaded once per process
    (per device context: the kernel's module is loaded in the context current at first use)."""

    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.funcs = {}
        # CUDA 12.3 added edge data to the dependency calls (the _v2 symbols, whose signature is
        # the same on every driver that has them; CUDA 13's headers give the plain names that
        # signature). Drivers before 12.3 have only the plain, edge-less ones.
        self.edges_v2 = hasattr(self.cu, "cuGraphNodeGetDependencies_v2")
        self.add_kernel_v2 = hasattr(self.cu, "cuGraphAddKernelNode_v2")

    def dependencies(self, node) -> list:
        if self.edges_v2:
            return self.nodes(lambda h, a, n: self.cu.cuGraphNodeGetDependencies_v2(h, a, None, n), node,
                              "cuGraphNodeGetDependencies_v2")
        return self.nodes(self.cu.cuGraphNodeGetDependencies, node, "cuGraphNodeGetDependencies")

    def dependents(self, node) -> list:
        if self.edges_v2:
            return self.nodes(lambda h, a, n: self.cu.cuGraphNodeGetDependentNodes_v2(h, a, None, n), node,
                              "cuGraphNodeGetDependentNodes_v2")
        return self.nodes(self.cu.cuGraphNodeGetDependentNodes, node, "cuGraphNodeGetDependentNodes")

    def add_edge(self, graph, a, b) -> None:
        one = ctypes.c_size_t(1)
        src, dst = ctypes.byref(ctypes.c_void_p(a)), ctypes.byref(ctypes.c_void_p(b))
        if self.edges_v2:
            self.check(self.cu.cuGraphAddDependencies_v2(graph, src, dst, None, one), "cuGraphAddDependencies_v2")
        else:
            self.check(self.cu.cuGraphAddDependencies(graph, src, dst, one), "cuGraphAddDependencies")

    def add_kernel(self, graph, deps: list, kp: KernelParams) -> ctypes.c_void_p:
        new = ctypes.c_void_p()
        arr = (ctypes.c_void_p * max(1, len(deps)))(*deps)
        add = self.cu.cuGraphAddKernelNode_v2 if self.add_kernel_v2 else self.cu.cuGraphAddKernelNode
        self.check(add(ctypes.byref(new), graph, arr if deps else None, ctypes.c_size_t(len(deps)), ctypes.byref(kp)),
                   "cuGraphAddKernelNode")
        return new

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else rc}")

    def fill_function(self, device: int) -> ctypes.c_void_p:
        f = self.funcs.get(device)
        if f is None:
            module, f = ctypes.c_void_p(), ctypes.c_void_p()
            self.check(self.cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(PTX.encode())),
                       "cuModuleLoadData (the fill kernel's PTX)")
            self.check(self.cu.cuModuleGetFunction(ctypes.byref(f), module, b"shm_fill"), "cuModuleGetFunction")
            self.funcs[device] = f
        return f

    def nodes(self, fn, handle, what: str) -> list:
        n = ctypes.c_size_t(0)
        self.check(fn(handle, None, ctypes.byref(n)), what)
        if n.value == 0:
            return []
        arr = (ctypes.c_void_p * n.value)()
        self.check(fn(handle, arr, ctypes.byref(n)), what)
        return list(arr[:n.value])


_driver: Optional[_Driver] = None
_lock = threading.Lock()
_supported: Optional[bool] = None


def supported() -> bool:
    """Whether this torch keeps a captured graph for editing (CUDAGraph(keep_graph=True), torch
    2.7 on) and the CUDA driver library loads."""
    global _supported
    if _supported is None:
        try:
            import torch
            torch.cuda.CUDAGraph(keep_graph=True)
            ctypes.CDLL("libcuda.so.1")
            _supported = True
        except (TypeError, OSError, RuntimeError):
            _supported = False
    return _supported


def _get_driver() -> _Driver:
    global _driver
    with _lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def memsets_to_kernels(raw_graph: int, device: int = 0) -> List[int]:
    """Replace each memset node of at most MAX_BYTES in the cudaGraph_t `raw_graph` with a
    fill-kernel node of the same edges; returns the bytes each replaced memset wrote. Call with
    the graph's device current."""
    d = _get_driver()
    cu = d.cu
    graph = ctypes.c_void_p(raw_graph)
    func = d.fill_function(device)
    replaced: List[int] = []
    for node in d.nodes(cu.cuGraphGetNodes, graph, "cuGraphGetNodes"):
        node = ctypes.c_void_p(node)
        kind = ctypes.c_int()
        d.check(cu.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != _MEMSET:
            continue
        p = MemsetParams()
        d.check(cu.cuGraphMemsetNodeGetParams(node, ctypes.byref(p)), "cuGraphMemsetNodeGetParams")
        dst, pitch, value, esize, width, height = fill_args(p)
        total = width * height
        if total == 0 or total * esize > MAX_BYTES:
            continue
        deps, outs = d.dependencies(node), d.dependents(node)
        args = [ctypes.c_uint64(dst), ctypes.c_uint64(pitch), ctypes.c_uint32(value), ctypes.c_uint32(esize),
                ctypes.c_uint64(width), ctypes.c_uint64(height)]
        argv = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        kp = KernelParams(func=func, gridDimX=min(MAX_BLOCKS, -(-total // THREADS)), gridDimY=1, gridDimZ=1,
                          blockDimX=THREADS, blockDimY=1, blockDimZ=1, sharedMemBytes=0,
                          kernelParams=ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p)), extra=None)
        new = d.add_kernel(graph, deps, kp)
        for o in outs:  # the new node feeds what the memset fed, at the priority of the first kernel
            d.add_edge(graph, new.value, o)
        for o in outs:
            okind = ctypes.c_int()
            d.check(cu.cuGraphNodeGetType(ctypes.c_void_p(o), ctypes.byref(okind)), "cuGraphNodeGetType")
            if okind.value == _KERNEL:
                v = LaunchAttrValue()
                if cu.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(o), _PRIORITY, ctypes.byref(v)) == 0:
                    d.check(cu.cuGraphKernelNodeSetAttribute(new, _PRIORITY, ctypes.byref(v)),
                            "cuGraphKernelNodeSetAttribute")
                break
        d.check(cu.cuGraphDestroyNode(node), "cuGraphDestroyNode")
        replaced.append(width * height * esize)
    return replaced
