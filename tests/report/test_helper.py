"""report/helper.py: the sweep's report drawn by a helper process is the report drawn in the
sweep's own process; a full disk is said as before; a helper that is gone leaves the sweep to
draw it itself."""
import glob
import os

from shmlearn.report import helper, write_report
from shmlearn.sweeps.trials import draw_report


def _figs(folder):
    return {os.path.basename(p): open(p, "rb").read() for p in glob.glob(os.path.join(folder, "figures", "*.png"))}


def test_the_helpers_report_is_the_one_drawn_here(fake_sweep, capfd):
    h = helper.start()
    try:
        assert draw_report(str(fake_sweep), h) is True
        assert capfd.readouterr().out == f"sweep: report {os.path.join(str(fake_sweep), 'report.html')}\n"
        theirs, page = _figs(fake_sweep), (fake_sweep / "report.html").read_text()
        proc = h.proc
    finally:
        h.close()
    assert h.proc is None and proc.returncode == 0  # it left at the end of its stdin
    write_report([str(fake_sweep)])
    assert len(theirs) == 8 and theirs == _figs(fake_sweep)
    assert page.count("<img") == (fake_sweep / "report.html").read_text().count("<img") == 10


def test_a_report_it_cannot_write_is_one_line_and_false(fake_sweep, capfd):
    (fake_sweep / "figures").write_text("a file where the figures' folder goes")
    h = helper.start()
    try:
        assert draw_report(str(fake_sweep), h) is False
    finally:
        h.close()
    err = capfd.readouterr().err
    assert err.startswith("sweep: could not write the report (") and err.count("\n") == 1
    assert f"`shmlearn report {fake_sweep}` writes it again" in err


def test_a_helper_that_died_leaves_the_report_to_the_sweep(fake_sweep, capfd):
    h = helper.start()
    h.proc.kill()
    h.proc.wait()
    try:
        assert h.draw(str(fake_sweep)) is None
        assert draw_report(str(fake_sweep), h) is True  # drawn here
    finally:
        h.close()
    assert capfd.readouterr().out.endswith("report.html\n") and len(_figs(fake_sweep)) == 8
