"""Kernels choose only what they can run (nn/fit.py, nn/choice.py): the choice made for devices
with less shared memory, an architecture that cannot compile a kernel, dtypes the kernels do not
take and odd shapes; the probe that switches a failing kernel off; forced kernels refused in one
line. Device limits are given (fit.override), so these run on the CPU."""
import copy
import os

import pytest
import torch
from torch import nn

triton = pytest.importorskip("triton")

from shmlearn.errors import BadInput  # noqa: E402
from shmlearn.nn import choice, conv_pool, fit, mlp_head  # noqa: E402
from triton_interp import interpreted_together as interpreted  # noqa: E402  (one interpreter process for the module)

CUDA = torch.device("cuda")  # never touched: the limits come from fit.override
TINY = fit.DeviceLimits("Tiny GPU", (9, 0), 16384)


@pytest.fixture(autouse=True)
def _compiled_not_interpreted(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def fake_needs(monkeypatch):
    """Triton's compile replaced by a table: fp32 pipelined tiles are big (as on an H100: 408 KB at
    Triton's default stages, 272 KB at 2, 40 KB unpipelined), bf16 ones small, and sm_70 cannot
    compile a bf16 dot."""
    calls = []

    def shared_bytes(fn, pointers, constexprs, num_warps, num_stages, cc):
        dtypes = {d for _, d in pointers}
        calls.append((fn.__name__, num_stages, cc))
        if torch.bfloat16 in dtypes and cc < (8, 0):
            raise RuntimeError("PassManager::run failed\nbf16 dot needs sm_80")
        if fn.__name__ == "weight_grad_rows_kernel" and torch.bfloat16 not in dtypes:
            return {None: 417792, 2: 278528, 1: 40960}.get(num_stages, 20480)
        return 20480

    monkeypatch.setattr(fit, "shared_bytes", shared_bytes)
    return calls


def _alexnet():
    from shmlearn.data.base import DataSpec
    from shmlearn.models import build_model
    return build_model("alexnet-small", DataSpec("cifar", "classification", (3, 32, 32), 10))


def test_fp32_tiles_too_big_for_an_h100_take_the_first_that_fits(fake_needs):
    from shmlearn.nn import _conv_pool_triton as kernels
    cand, why = kernels.wgrad_config(3, 32, 5, 5, torch.float32, fit.KNOWN["h100"])
    assert why is None and cand.num_stages == 1 and cand.kwargs == {"BLOCK_Q": 64}
    cand, why = kernels.wgrad_config(3, 32, 5, 5, torch.bfloat16, fit.KNOWN["h100"])
    assert why is None and cand.num_stages is None  # bf16: Triton's default pipelining
    cand, why = kernels.wgrad_config(3, 32, 5, 5, torch.float32, fit.KNOWN["a100"])
    assert cand is not None and cand.num_stages == 1  # 272 KB > 163 KB too


def test_a_device_with_little_shared_memory_runs_torchs_ops_and_says_why(fake_needs):
    model = _alexnet()
    ref = copy.deepcopy(model)
    with fit.override(TINY):
        made = choice.choose(model, conv_pool_mode="triton", mlp_head_mode="triton", dtype=torch.bfloat16,
                             device=CUDA)
    blocks = [c for c in made if c.kernel == "conv-pool"]
    assert len(blocks) == 3 and all(c.path == "torch" for c in blocks)
    assert blocks[0].layer == "0 (conv 3->32 5x5)"
    assert blocks[0].why == "forward: needs 20480 bytes of shared memory a block, Tiny GPU has 16384"
    assert not any(type(m) is conv_pool.ConvReluPool2d for m in model.modules())  # nothing converted
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)  # the same modules, the same function
    with pytest.raises(BadInput, match=r"^--conv-pool triton: 0 \(conv 3->32 5x5\) cannot run shmlearn's "
                                       r"kernel on Tiny GPU \(forward: needs 20480 bytes .*\); use --conv-pool auto"):
        choice.check_forced(made, {"conv-pool": True}, "Tiny GPU")
    choice.check_forced(made, {"conv-pool": False}, "Tiny GPU")  # auto: no error


def test_an_architecture_that_cannot_compile_the_kernel_keeps_torchs_ops(fake_needs):
    model = _alexnet()
    with fit.override(fit.KNOWN["v100"]):
        made = choice.choose(model, conv_pool_mode="triton", mlp_head_mode="triton", dtype=torch.bfloat16,
                             device=CUDA)
    head = [c for c in made if c.kernel == "mlp-head"]
    assert len(head) == 1 and head[0].path == "torch"
    assert head[0].why.startswith("forward: Triton cannot compile it for sm_70 (RuntimeError: bf16 dot needs sm_80)")
    assert all(c.path == "torch" for c in made)


def test_fp32_heads_are_not_fused_and_a_forced_head_in_fp32_is_not_refused(fake_needs):
    model = _alexnet()
    with fit.override(fit.KNOWN["h100"]):
        made = choice.choose(model, conv_pool_mode="triton", mlp_head_mode="triton", dtype=torch.float32,
                             device=CUDA)
    head = [c for c in made if c.kernel == "mlp-head"][0]
    assert head.path == "torch" and head.why == "float32: the fused head runs in bf16 or fp16 only"
    assert [c.path for c in made if c.kernel == "conv-pool"] == ["triton"] * 3
    assert sum(type(m) is conv_pool.ConvReluPool2d for m in model.modules()) == 3
    assert not any(type(m) is mlp_head.MLPHead for m in model.modules())
    choice.check_forced(made, {"mlp-head": True, "conv-pool": True}, "H100")  # fp32 head: torch, as documented


def test_odd_shapes_are_never_offered_to_the_kernels(fake_needs):
    net = nn.Sequential(nn.Conv2d(3, 200, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # > MAX_OUT channels
                        nn.Conv2d(200, 16, 3, stride=2), nn.ReLU(), nn.MaxPool2d(2),  # stride 2
                        nn.Conv2d(16, 16, 3, dilation=2), nn.ReLU(), nn.MaxPool2d(3),  # 3x3 pool
                        nn.Flatten(), nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 10))  # 300 > MAX_WIDTH
    with fit.override(fit.KNOWN["h100"]):
        assert choice.choose(net, conv_pool_mode="triton", mlp_head_mode="triton", dtype=torch.bfloat16,
                             device=CUDA) == []
    assert fake_needs == []  # nothing compiled for them


def test_the_cpu_and_the_interpreter_take_no_limits(fake_needs):
    model = _alexnet()
    assert conv_pool.block_why_not(model[0], torch.float32, torch.device("cpu")) is None
    assert fake_needs == []


def test_a_real_compile_finds_the_fp32_tile_too_big_for_an_h100():
    """Triton's own compile for sm_90 (ptxas comes with Triton: no GPU needed): the pipelined fp32
    tile that failed on H100s (421888 bytes there, torch 2.11's Triton) is refused, the next
    candidate that fits is taken."""
    from shmlearn.nn import _conv_pool_triton as kernels
    h100 = fit.KNOWN["h100"]
    consts = kernels._rows_constexprs(3, 32, 5, 5)
    ptrs = {"xr_ptr": torch.float32, "dy_ptr": torch.float32, "code_ptr": torch.uint8, "dw_ptr": torch.float32}
    try:
        why = fit.why_not(kernels.weight_grad_rows_kernel, ptrs, consts, kernels.WGRAD_ROWS[0], h100)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"Triton cannot compile for sm_90 here: {e}")
    if why and "cannot compile" in why:
        pytest.skip(why)
    assert why is not None and why.startswith("needs ") and why.endswith("H100 has 232448")
    assert int(why.split()[1]) > 232448
    cand, why = kernels.wgrad_config(3, 32, 5, 5, torch.float32, h100)
    assert why is None and cand in kernels.WGRAD_ROWS[1:]


class _Fails(Exception):
    pass


@interpreted
def test_a_kernel_that_fails_at_the_first_step_is_switched_off_and_the_run_is_unchanged(monkeypatch):
    """The probe: the fused forward raises as Triton does when it runs out of resources; the
    blocks go back to torch's ops, the note names the flag and the error, and BatchNorm's
    statistics and the RNG are as before the probe."""
    from triton.runtime.errors import OutOfResources
    from shmlearn.nn import _conv_pool_triton as kernels

    def broken(*a, **k):
        raise OutOfResources(421888, 232448, "shared memory")

    monkeypatch.setattr(kernels, "forward", broken)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.BatchNorm2d(16),
                        nn.Dropout(0.5), nn.Flatten(), nn.Linear(16 * 4 * 4, 10))
    ref = copy.deepcopy(net)
    assert conv_pool.convert(net, "triton") == 1
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    state = torch.get_rng_state()
    import contextlib
    notes = choice.probe(net, lambda: (x, y), nn.functional.cross_entropy, contextlib.nullcontext,
                         torch.device("cpu"))
    assert len(notes) == 1 and notes[0].startswith("--conv-pool: shmlearn's kernel failed on this device "
                                                   "(OutOfResources: out of resource: shared memory")
    assert notes[0].endswith("torch's ops run those layers")
    assert choice.running(net) == [] and type(net[0]) is nn.Conv2d
    assert torch.equal(torch.get_rng_state(), state)
    for a, b in zip(net.buffers(), ref.buffers()):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in net.parameters())


@interpreted
def test_an_error_that_is_no_kernels_is_raised():
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(16 * 4 * 4, 10))
    conv_pool.convert(net, "triton")
    import contextlib

    def bad_loss(out, y):
        raise _Fails("the user's loss")

    with pytest.raises(_Fails):
        choice.probe(net, lambda: (torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long)), bad_loss,
                     contextlib.nullcontext, torch.device("cpu"))
    assert choice.running(net) == ["conv-pool"]
