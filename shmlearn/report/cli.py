"""`shmlearn report PATH...`: one self-contained HTML page for a run, runs side by side, or a sweep."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page for runs or a sweep",
                       description="Write one HTML page (figures embedded, works offline) for a run "
                                   "directory, several run directories side by side, or a sweep directory. "
                                   "A single run or sweep also gets its figures as PNG files in PATH/figures/.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="run directories, or one sweep directory")
    p.add_argument("--out", help="HTML file to write. Default: PATH/report.html for one path, "
                                 "./report.html for several")
    p.set_defaults(func=cmd_report)


def cmd_report(ns: argparse.Namespace) -> int:
    from shmlearn.report import write_report  # lazy: matplotlib (the figures)
    from shmlearn.record.safe_write import cli_output  # lazy: the report subcommand only
    with cli_output("report"):  # a full disk, a read-only folder: one line, earlier files kept
        print(write_report(ns.paths, out=ns.out))
    return 0
