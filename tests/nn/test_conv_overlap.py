"""shmlearn/nn/conv_overlap.py: a convolution whose backward runs its two GEMMs apart gives
torch's gradients, eagerly and compiled, and the module swap leaves the model as it was.

On the CPU the two halves run one after the other: what is checked here is the split (the
masks, the layouts, the casts); the streams themselves are checked on a GPU by
benchmarks/kernels.py --cases conv-overlap-1,conv-overlap-3,conv-overlap-4 (outputs_agree)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from inductor import needs_build
from shmlearn.errors import BadInput
from shmlearn.nn import conv_overlap
from shmlearn.nn.conv_overlap import OverlapConv2d, conv2d
from triton_interp import interpreted


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),  # strided, with a bias
        nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=4), nn.ReLU(),  # dilated, grouped
        nn.Conv2d(16, 8, 1, bias=False), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))


def _grads(model, x, autocast=False, run=None):
    """run: what computes model's forward (model itself, or its compiled form)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = (run or model)(x)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("channels_last,autocast", [(False, False), (True, False), (True, True)])
def test_eager_gradients_equal_torchs_bit_for_bit(channels_last, autocast):
    """autocast: the parameters are cast to bf16 inside the op's Function and their gradients
    cast back by the op (where the GEMM ran): the same fp32 gradients as autocast's own casts."""
    ref = _net()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ref = ref.to(memory_format=fmt)
    net = copy.deepcopy(ref)
    assert conv_overlap.convert(net, "all") == 4
    x = torch.randn(4, 3, 12, 12).contiguous(memory_format=fmt)
    out_r, g_r = _grads(ref, x, autocast=autocast)
    out, g = _grads(net, x, autocast=autocast)
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(out, out_r)
    for name in g_r:
        assert g[name].dtype == torch.float32, name
        assert torch.equal(g[name], g_r[name]), name
        assert g[name].stride() == g_r[name].stride(), name


@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_the_compile_options_of_a_deferred_backward_stop_inductors_buffer_reuse():
    """A deferred weight GEMM still reads its gradient and input on the side stream after the op
    returns: the backward Inductor writes must not put a later result into those buffers (on the
    CPU Inductor writes the same buffer plan: `# reuse` lines in its code, without the options)."""
    from torch._inductor.utils import run_and_get_code
    net = _net().to(memory_format=torch.channels_last)
    conv_overlap.convert(net, "all")
    x = torch.randn(4, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    codes = {}
    for name, options in (("default", None), ("deferred", conv_overlap.INDUCTOR_OPTIONS)):
        torch._dynamo.reset()
        run = torch.compile(net, options=options)
        _, code = run_and_get_code(lambda: _grads(net, x, autocast=True, run=run))
        codes[name] = "\n".join(code)
    assert "conv2d_backward_overlap" in codes["deferred"]
    assert "# reuse" in codes["default"]  # the control: the default plan does reuse
    assert "# reuse" not in codes["deferred"] and "in_out_ptr" not in codes["deferred"]


def test_the_input_gradient_alone_and_the_weight_gradient_alone():
    torch.manual_seed(1)
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    w = torch.randn(6, 4, 3, 3, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    gy = torch.randn(2, 6, 6, 6)
    ref = torch.autograd.grad(F.conv2d(x, w, b, 1, 1), (x, w, b), gy)
    for wanted in [(x,), (w,), (w, b), (x, b)]:
        got = torch.autograd.grad(conv2d(x, w, b, (1, 1), (1, 1)), wanted, gy)
        for t, g in zip(wanted, got):
            i = [id(x), id(w), id(b)].index(id(t))
            assert torch.equal(g, ref[i])


@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_compiled_bf16_step_matches_the_eager_modules_and_makes_one_graph():
    ref = _net().to(memory_format=torch.channels_last)
    net = copy.deepcopy(ref)
    conv_overlap.convert(net, "all")
    x = torch.randn(4, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(net)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    out_r, g_r = _grads(ref, x, autocast=True)
    out, g = _grads(net, x, autocast=True, run=torch.compile(net))
    assert out.dtype == out_r.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), out_r.float(), rtol=2e-2, atol=2e-2)
    for name in g_r:
        scale = g_r[name].abs().max().item()
        torch.testing.assert_close(g[name], g_r[name], rtol=0.05, atol=0.05 * scale, msg=name)


def test_convert_both_ways_keeps_the_state_and_skips_what_it_cannot_run():
    net = _net()
    odd = nn.Conv2d(8, 8, 3, padding="same")  # string padding: left to torch
    circular = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")
    net.add_module("odd", odd)
    net.add_module("circular", circular)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    assert conv_overlap.convert(net, "all") == 4
    assert type(odd) is nn.Conv2d and type(circular) is nn.Conv2d
    assert sum(type(m) is OverlapConv2d for m in net.modules()) == 4
    assert conv_overlap.convert(net, "small") == 4  # again, with the other limit
    assert {m.overlap_rows for m in net.modules() if type(m) is OverlapConv2d} == {conv_overlap.SMALL_ROWS}
    assert conv_overlap.convert(net, "off") == 0
    assert not any(type(m) is OverlapConv2d or "overlap_rows" in m.__dict__ for m in net.modules())
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    with pytest.raises(ValueError, match="one of off, small, all"):
        conv_overlap.convert(net, "auto")


class _Calls(TorchDispatchMode):
    """The output masks of every aten.convolution_backward call under it, those inside shmlearn's
    op too (a mode is off while it handles a call: it enters itself again around the op's)."""

    def __init__(self):
        super().__init__()
        self.masks = []
        conv_overlap._ops()  # defines torch.ops.shmlearn.conv2d_backward_overlap (on first use) before it is looked up

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution_backward.default:
            self.masks.append(tuple(args[-1]))
        if func is torch.ops.shmlearn.conv2d_backward_overlap.default:
            with self:
                return conv_overlap.backward_impl(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_the_gemms_run_apart_only_up_to_the_row_limit():
    torch.manual_seed(2)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)  # output 2 x 8 x 8 = 128 rows
    w = torch.randn(6, 4, 3, 3, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    ref = torch.autograd.grad(F.conv2d(x, w, b, 1, 1).square().sum(), (x, w, b))
    for rows, want in ((128, [(False, True, True), (True, False, False)]), (127, [(True, True, True)])):
        with _Calls() as calls:
            got = torch.autograd.grad(conv2d(x, w, b, (1, 1), (1, 1), rows=rows).square().sum(), (x, w, b))
        assert calls.masks == want, rows
        for g, r in zip(got, ref):
            assert torch.equal(g, r)


def test_unbatched_input_runs_torchs_module():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    ref = conv(torch.ones(3, 5, 5))
    conv_overlap.convert(nn.Sequential(conv), "all")
    assert torch.equal(conv(torch.ones(3, 5, 5)), ref)


def test_the_flop_count_is_torchs():
    from torch.utils.flop_counter import FlopCounterMode
    ref, net = _net(), _net()
    conv_overlap.convert(net, "all")
    x = torch.randn(2, 3, 12, 12)
    counts = []
    for m in (ref, net):
        with FlopCounterMode(display=False) as fc:
            m(x).sum().backward()
        counts.append(fc.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_auto_is_off_on_the_cpu_and_small_or_all_is_refused_there():
    cpu = torch.device("cpu")
    assert conv_overlap.resolve("auto", cpu) == "off"
    assert conv_overlap.resolve("auto", cpu, deferred=True) == "off"
    assert conv_overlap.resolve("all", cpu) == "all"
    # On CUDA auto is every convolution where the step defers the weight GEMMs (faster than off at
    # batch 128 and 1024), the small ones where it cannot (each op joins its streams: all was slower).
    cuda = torch.device("cuda")
    assert conv_overlap.resolve("auto", cuda, deferred=True) == "all"
    assert conv_overlap.resolve("auto", cuda, deferred=False) == "small"
    assert "needs a CUDA device" in conv_overlap.usable(cpu)
    from shmlearn.config.train_config import TrainConfig, validate
    from shmlearn.step.fast import StepOptions, Stepper
    from shmlearn.sync import build_strategy
    with pytest.raises(BadInput, match=r"^--conv-overlap both: choose one of off, small, all, auto$"):
        validate(TrainConfig(conv_overlap="both"))
    model = _net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    strategy = build_strategy("allreduce", rank=0, world_size=1)
    strategy.setup(model, opt)
    for mode in ("small", "all"):
        with pytest.raises(BadInput, match=r"--conv-overlap small\|all needs a CUDA device"):
            Stepper(model=model, strategy=strategy, optimizer=opt, schedule=None, loader=None, task="classification",
                    device=cpu, opts=StepOptions(conv_overlap=mode), timer=None, rank=0, world_size=1,
                    total_steps=1)


@interpreted
def test_a_fused_conv_pool_block_takes_the_split_backward_with_the_same_gradients():
    from shmlearn.nn import conv_pool
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    assert conv_pool.convert(net, "triton") == 2
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    _, g_serial = _grads(net, x)
    assert conv_pool.set_overlap(net, True) == 1  # the image's block has no cuDNN backward
    assert net[3].__dict__["overlap"] and net[0].__dict__["overlap"]
    _, g_split = _grads(net, x)
    for name in g_serial:
        assert torch.equal(g_split[name], g_serial[name]), name
    conv_pool.convert(net, "off")
    assert "overlap" not in net[3].__dict__


def test_a_run_with_every_convolution_split_is_the_same_run_and_says_so(tmp_path, monkeypatch):
    """Through shmlearn.train: a resnet18 run whose 20 plain convolutions take the split backward
    (allowed on the CPU here, where the halves run one after the other) ends with the same
    parameters, bit for bit, as the run without; summary.json counts them. 2 steps of 16 (the
    second on weights the split gradients moved) and one evaluation of 32 test samples: digits'
    360 test samples through resnet18 and 4 steps took ~3x as long on 2 cores."""
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    from triton_interp import small_digits
    monkeypatch.setattr(conv_overlap, "usable", lambda device: None)
    data = small_digits(32)
    runs = [shmlearn.train(TrainConfig(model="resnet18", samples=32, batch_size=16, workers=1,
                                       conv_overlap=mode, device="cpu", progress=False, eval_points=1, eval_at_start="off",
                                       deterministic=True, out=str(tmp_path / mode)), data=data) for mode in ("off", "all")]
    assert runs[1].summary["steps"] == 2
    assert (runs[0].summary["conv_overlap"], runs[0].summary["conv_overlaps"]) == ("off", 0)
    assert (runs[1].summary["conv_overlap"], runs[1].summary["conv_overlaps"]) == ("all", 20)
    assert runs[1].summary["conv_overlap_deferred"] is False  # no streams on the CPU: nothing to defer
    assert sum(type(m) is OverlapConv2d for m in runs[1].model.modules()) == 20
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_sink_takes_each_convolutions_gradients_as_torch_makes_them(autocast):
    """Inside deferred(sink=...), a convolution with a slot hands dw and db (in the GEMM's dtype)
    to the sink once per backward, through both paths (the first convolution needs no input
    gradient: one call; the others split), and returns placeholders of the parameters' shape."""
    ref = _net().to(memory_format=torch.channels_last)
    net = copy.deepcopy(ref)
    conv_overlap.convert(net, "all")
    trainable = list(net.parameters())
    slots = conv_overlap.set_slots(net, trainable)
    convs = [n for n, m in net.named_modules() if type(m) is OverlapConv2d]
    assert [s[2] for s in slots.values()] == convs
    x = torch.randn(4, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    _, g_r = _grads(ref, x, autocast=autocast)
    taken, placed = {}, {}

    def sink(slot, dw, db, placeholders):
        assert slot not in taken
        taken[slot] = (dw.clone(), None if db is None else db.clone())
        placed[slot] = placeholders[0].data_ptr()  # not the tensor: a reference would make autograd copy it

    with conv_overlap.deferred(torch.device("cpu"), sink=sink):
        _grads(net, x, autocast=autocast)
    names = dict(net.named_parameters())
    assert sorted(taken) == sorted(slots)
    for slot, (w, b, name) in slots.items():
        dw, db = taken[slot]
        assert dw.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert dw.stride() == names[name + ".weight"].stride()  # laid out as the parameter
        assert torch.equal(dw.float(), g_r[name + ".weight"])  # autocast's cast back is exact
        assert (db is None) == (b is None)
        if db is not None:
            assert torch.equal(db.float(), g_r[name + ".bias"])
        assert names[name + ".weight"].grad.data_ptr() == placed[slot]  # the placeholder, taken as it is
    # Without a sink, the same modules return the gradients again.
    _, g = _grads(net, x, autocast=autocast)
    for name in g_r:
        assert torch.equal(g[name], g_r[name]), name


def test_slots_skip_shared_weights_and_modules_and_clear():
    net = _net()
    shared = net[3]
    net.add_module("again", shared)  # one module at two places
    tied = nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=4)
    tied.weight = net[5].weight  # one weight in two modules
    net.add_module("tied", tied)
    net[7].weight.requires_grad_(False)  # frozen: not trainable
    conv_overlap.convert(net, "all")
    trainable = [p for p in net.parameters() if p.requires_grad]
    slots = conv_overlap.set_slots(net, trainable)
    assert [s[2] for s in slots.values()] == ["0"]
    assert slots[0] == (0, None, "0")
    assert net[0].grad_slot == 0 and net[3].grad_slot == -1
    conv_overlap.clear_slots(net)
    assert all(m.grad_slot == -1 for m in net.modules() if type(m) is OverlapConv2d)


@pytest.mark.parametrize("compiled", [False, True])
@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_a_weight_copy_is_read_inside_weight_copies_only_and_gives_the_casts_results(compiled):
    """Given copies of their weights in bf16 (set_weight_copies), the convolutions read them under
    bf16 autocast inside weight_copies: with the weights cast there, the same outputs and fp32
    gradients as the same module casting, bit for bit, eagerly and compiled; with zeros there, other
    outputs (the copy is what is read); outside the context (evaluation, a user's call) the module
    casts its weight and the copy is not read."""
    ref = _net().to(memory_format=torch.channels_last)
    net = copy.deepcopy(ref)
    conv_overlap.convert(net, "all")
    x = torch.randn(4, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    copies = {id(m.weight): m.weight.detach().to(torch.bfloat16) for m in net.modules() if type(m) is OverlapConv2d}
    assert all(c.stride() == m.weight.stride() for m in net.modules() if type(m) is OverlapConv2d
               for c in [copies[id(m.weight)]])
    assert conv_overlap.set_weight_copies(net, lambda p: copies.get(id(p))) == 4
    run = torch.compile(net, backend="inductor", dynamic=False) if compiled else net
    out_r, g_r = _grads(net, x, autocast=True, run=run)  # outside: each weight cast, as autocast does
    if not compiled:
        assert torch.equal(out_r, _grads(ref, x, autocast=True)[0])
    with conv_overlap.weight_copies():
        out, g = _grads(net, x, autocast=True, run=run)
    assert torch.equal(out, out_r)
    for name in g_r:
        assert g[name].dtype == torch.float32 and torch.equal(g[name], g_r[name]), name
    for c in copies.values():  # the copies now differ from the weights: which one is read shows
        c.zero_()
    outside, _ = _grads(net, x, autocast=True, run=run)
    assert torch.equal(outside, out_r)
    with conv_overlap.weight_copies():
        inside, g0 = _grads(net, x, autocast=True, run=run)
    assert not torch.equal(inside, out_r)
    assert conv_overlap.set_weight_copies(net, lambda p: None) == 0
    assert not any("weight_copy" in m.__dict__ for m in net.modules())


def test_a_weight_copy_must_be_laid_out_as_its_weight():
    net = _net().to(memory_format=torch.channels_last)
    conv_overlap.convert(net, "all")
    with pytest.raises(ValueError, match="laid out as its weight"):
        conv_overlap.set_weight_copies(net, lambda p: torch.zeros(p.shape, dtype=torch.bfloat16))
