"""shmlearn/bench/roofline.py: bytes and FLOPs per operator against hand-computed values, and
every operator's time attributed from the profiler."""
import pytest
import torch
import torch.nn.functional as F

from shmlearn.bench.roofline import Limits, Op, OpLog, record, rows


def _log(fn):
    log = OpLog()
    with log:
        fn()
    return log.ops


def test_a_convolutions_flops_forward_and_backward_are_the_textbook_count():
    n, cin, cout, hw, k = 2, 3, 8, 6, 3
    x = torch.randn(n, cin, hw, hw)
    w = torch.randn(cout, cin, k, k, requires_grad=True)
    macs = n * cout * hw * hw * cin * k * k  # padding 1 keeps H and W
    ops = _log(lambda: F.conv2d(x, w, padding=1).sum().backward())
    conv = [o for o in ops if o.name == "convolution"]
    back = [o for o in ops if o.name == "convolution_backward"]
    assert [o.flops for o in conv] == [2 * macs]
    assert [o.flops for o in back] == [2 * macs]  # the weight's gradient only: x needs none
    x.requires_grad_(True)
    ops = _log(lambda: F.conv2d(x, w, padding=1).sum().backward())
    assert [o.flops for o in ops if o.name == "convolution_backward"] == [4 * macs]


def test_bytes_count_reads_and_writes_once_each_in_place_and_broadcast_included():
    a, b = torch.randn(1000), torch.randn(1000)
    (add,) = _log(lambda: torch.add(a, b))
    assert (add.read, add.written, add.flops, add.dtype) == (8000, 4000, 0, "float32")
    (add_,) = _log(lambda: a.add_(b))
    assert (add_.read, add_.written) == (8000, 4000)  # a is read and written in place
    big, row = torch.randn(50, 1000), torch.randn(1, 1000)
    exp = row.expand(50, 1000)
    (bcast,) = _log(lambda: torch.add(big, exp))
    assert bcast.read == 50 * 1000 * 4 + 1000 * 4  # the expanded row is read from its 4 kB
    assert bcast.written == 50 * 1000 * 4


def test_a_gather_reads_the_rows_it_picks_not_the_whole_table():
    table = torch.randn(10000, 64)
    idx = torch.arange(32)
    (sel,) = _log(lambda: table.index_select(0, idx))
    assert sel.read == 32 * 64 * 4 + 32 * 8 and sel.written == 32 * 64 * 4


def test_every_operator_of_a_step_gets_its_own_time_from_the_profiler():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    ops = record(lambda: F.cross_entropy(m(x), y).backward(), torch.device("cpu"))
    names = [o.name for o in ops]
    assert names.count("addmm") == 2 and names.count("mm") >= 3 and "threshold_backward" in names
    assert all(o.device_us > 0 for o in ops)
    mm = [o for o in ops if o.name == "addmm"]
    assert sorted(o.flops for o in mm) == sorted([2 * 16 * 64 * 32, 2 * 16 * 32 * 10])


def test_rows_give_each_operator_its_floor_and_the_limit_that_sets_it():
    lim = Limits("test", bandwidth=1e9, bf16_flops=1e12, fp32_flops=1e11)
    ops = [Op(0, "mm", 1000, 1000, 10 ** 9, "bfloat16", 5000.0),      # 2 us of bytes, 1000 us of FLOPs
           Op(1, "add", 3000, 1000, 0, "float32", 10.0),                # 4 us of bytes
           Op(2, "add", 3000, 1000, 0, "float32", 10.0),
           Op(3, "mm", 10 ** 6, 0, 10 ** 6, "float32", 0.0)]            # no kernel time: left out
    r = {g["op"]: g for g in rows(ops, lim)}
    assert r["mm"]["calls"] == 1 and r["mm"]["min_us"] == pytest.approx(1000.0) and r["mm"]["bound"] == "compute"
    assert r["mm"]["of_limit"] == pytest.approx(0.2)
    assert r["add"]["calls"] == 2 and r["add"]["min_us"] == pytest.approx(8.0) and r["add"]["bound"] == "memory"
    assert r["add"]["of_limit"] == pytest.approx(0.4)
    assert [g["op"] for g in rows(ops, lim)] == ["mm", "add"]  # slowest first
