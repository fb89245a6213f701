"""Where a run's start-up goes, function by function (issue 52): one `shmlearn ...` command run in
this process under cProfile, its profile saved and the top entries printed, by cumulative and by
own time. A 1-worker run (one GPU, or --workers 1) trains in this process, so the profile covers
everything but the interpreter's start; runs of 2+ workers are profiled only up to their workers.

    python benchmarks/start_profile.py OUT.prof -- train --device cuda --model alexnet-small --no-progress

cProfile slows Python-heavy code (1.3-2x); the split between phases, not the total, is what it is for.
Set TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR / SHMLEARN_CACHE_DIR to fresh folders for a cold run.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time


def main() -> int:
    if "--" not in sys.argv or sys.argv.index("--") != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, argv = sys.argv[1], sys.argv[3:]
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    try:
        from shmlearn.cli import main as cli_main
        code = cli_main.main(argv)
    finally:
        prof.disable()
        wall = time.perf_counter() - t0
        prof.dump_stats(out)
    print(f"\n== {' '.join(argv)}: exit {code}, {wall:.2f} s in this process under cProfile; "
          f"torch._dynamo imported: {'torch._dynamo' in sys.modules}")
    for order, n in (("cumulative", 45), ("tottime", 25)):
        print(f"\n== by {order}")
        pstats.Stats(out).strip_dirs().sort_stats(order).print_stats(n)
    return code


if __name__ == "__main__":
    sys.exit(main())
