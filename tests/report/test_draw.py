"""report/draw.py: figures drawn side by side in forked copies give the bytes one process draws;
a figure's error, and a copy that dies, end as they would with one process."""
import glob
import os
import time

import pytest

from shmlearn.report import draw, write_report


@pytest.fixture(autouse=True)
def _no_other_thread(monkeypatch):
    """draw_all forks only with no other Python thread in the process; a pytest-xdist worker has its
    own (execnet's), where these tests would then draw in one process and test nothing of the
    copies (the clean-clone CI). The copies here only draw and exit. The thread test sets its own."""
    monkeypatch.setattr(draw.threading, "active_count", lambda: 1)


def _figs(folder):
    return {os.path.basename(p): open(p, "rb").read() for p in glob.glob(os.path.join(folder, "figures", "*.png"))}


def test_a_sweep_report_drawn_side_by_side_is_the_report_drawn_in_one_process(fake_sweep, monkeypatch, tmp_path):
    real = draw._draw_taken

    def copy(todo, taken, send):  # in a copy: say who drew how many
        class Counted:
            def send(self, out):
                (tmp_path / f"copy-{os.getpid()}").write_text(str(len(out)))
                send.send(out)

            def close(self):
                send.close()
        real(todo, taken, Counted())
    monkeypatch.setattr(draw, "_cores", lambda: 3)  # three processes, also on a 1-core machine
    monkeypatch.setattr(draw, "_draw_taken", copy)
    write_report([str(fake_sweep)])
    apart = _figs(fake_sweep)
    page = (fake_sweep / "report.html").read_text()
    copies = {p.name: int(p.read_text()) for p in tmp_path.glob("copy-*")}
    assert len(copies) == 2 and f"copy-{os.getpid()}" not in copies and sum(copies.values()) <= 10
    monkeypatch.setattr(draw, "_cores", lambda: 1)
    write_report([str(fake_sweep)])
    assert len(apart) == 8 and apart == _figs(fake_sweep)  # the same PNG bytes
    assert page.count("<img") == (fake_sweep / "report.html").read_text().count("<img") == 10


def _square(x):
    return bytes([x * x])


def _fails(x):
    raise ValueError(f"figure {x} failed")


def test_each_figure_gets_its_own_bytes_in_page_order():
    items = [draw.Later(_square, x) for x in range(7)]
    draw.draw_all(items, procs=3)
    assert [i.data for i in items] == [bytes([x * x]) for x in range(7)] and all(i.done for i in items)


def test_a_figure_that_fails_in_a_copy_raises_its_error_here():
    items = [draw.Later(_square, 1), draw.Later(_fails, 2), draw.Later(_square, 3)]
    with pytest.raises(ValueError, match="figure 2 failed"):
        draw.draw_all(items, procs=2)  # the copy draws item 2; its share is drawn again here


def test_a_copy_that_dies_has_what_it_took_drawn_here(monkeypatch):
    monkeypatch.setattr(draw, "_draw_taken", lambda todo, taken, send: (next(draw._taken(taken)), os._exit(1)))
    items = [draw.Later(_square, x) for x in range(4)]
    draw.draw_all(items, procs=2)
    assert [i.data for i in items] == [bytes([x * x]) for x in range(4)]


def test_with_another_thread_running_it_draws_in_this_process(monkeypatch):
    monkeypatch.setattr(draw.threading, "active_count", lambda: 2)
    monkeypatch.setattr(draw, "_draw_taken", lambda todo, taken, send: pytest.fail("forked beside a thread"))
    items = [draw.Later(_square, x) for x in range(4)]
    draw.draw_all(items, procs=2)
    assert [i.data for i in items] == [bytes([x * x]) for x in range(4)]


def _drawn_by(x, owner, slow):
    """The pid that drew it; a copy (not `owner`) draws `slow` times slower."""
    time.sleep(0.05 * (slow if os.getpid() != owner else 1))
    return str(os.getpid()).encode()


def test_a_slow_copy_leaves_the_figures_left_to_the_others():
    """Each process takes the next figure left: a copy on a core that other work shares draws
    fewer (a fixed share each would have left it half of them, and the report waiting on it)."""
    items = [draw.Later(_drawn_by, x, os.getpid(), 10) for x in range(6)]
    draw.draw_all(items, procs=2)
    by_copy = [i for i in items if i.data != str(os.getpid()).encode()]
    assert all(i.done and i.data for i in items) and len(by_copy) <= 1
