"""Figures (matplotlib, PNG) and one self-contained HTML page for a run, runs side by side, or a
sweep. `write_report(paths)` is the whole API; the CLI is `shmlearn report PATH...`.

    load.py           read run and sweep directories
    mpl.py            figures on an Agg canvas (no pyplot), their layout, PNG bytes
    run_figures.py    loss / accuracy vs time, phase bars (one run or several overlaid)
                      and the three as one figure (a sweep winner's own plots)
    sweep_figures.py  heat maps, sorted-area histograms, phases and throughput vs workers
    html.py           the page: inline CSS, base64 images, no script
    draw.py           the figures drawn side by side, in forked copies of the process
    pages.py          what goes on each kind of page
"""
from __future__ import annotations

import gc
import os
from typing import Optional, Sequence

from shmlearn.record import safe_write
from shmlearn.errors import BadInput

__all__ = ["write_report"]


def write_report(paths: Sequence[str], out: Optional[str] = None) -> str:
    """Write the HTML page for `paths` (one sweep directory, or run directories) and return its
    path. One path also gets its figures as PATH/figures/NAME.png."""
    from .load import is_run, is_sweep, load_run, load_sweep  # lazy: matplotlib (the figures)
    from .pages import runs_page, sweep_page  # lazy: matplotlib (the figures)

    paths = [str(p) for p in paths]
    if not paths:
        raise BadInput("report: give a run or sweep directory")
    for p in paths:
        if not os.path.isdir(p):
            raise BadInput(f"{p}: no such directory")
    sweeps = [p for p in paths if is_sweep(p)]
    if sweeps and len(paths) > 1:
        raise BadInput(f"{sweeps[0]}: a sweep directory is reported on its own; give it alone")
    for p in paths:
        if not sweeps and not is_run(p):
            raise BadInput(f"{p}: neither a run directory (metrics.jsonl) nor a sweep (results.jsonl)")
    # Drawing makes enough long-lived objects (matplotlib figures are cyclic) to set off a full
    # collection, which walks every object of the process: at the end of a sweep (torch loaded,
    # ~220k objects) a pause of a sixth of the report (docs/performance.md, "Behind the code").
    # The objects from before the report are frozen out of the walk meanwhile (unless the caller
    # froze some: a freeze does not nest), and unfrozen after; the figures' garbage goes with the
    # next full collection, as it would.
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        page, figs = sweep_page(load_sweep(sweeps[0])) if sweeps else runs_page([load_run(p) for p in paths])
    finally:
        if freeze:
            gc.unfreeze()
    out = out or (os.path.join(paths[0], "report.html") if len(paths) == 1 else "report.html")
    if os.path.isdir(out):
        raise BadInput(f"--out {out}: a directory; give the HTML file to write (e.g. {os.path.join(out, 'report.html')})")
    # Each file whole or as it was (safe_write): a full disk or a read-only folder loses no
    # earlier report or figure. The figures first, then the page that shows them.
    if len(paths) == 1:
        fig_dir = os.path.join(paths[0], "figures")
        safe_write.makedirs(fig_dir, root=paths[0])
        for name, data in figs.items():
            safe_write.write(os.path.join(fig_dir, f"{name}.png"), data, root=paths[0], fsync=False)
    safe_write.write(out, page.render())
    return out
