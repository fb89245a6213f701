"""Numbers out of range (issue 53): simulate's network and slots, advise's worker range and
target, a sweep's threshold and counts, a scheduler's or optimizer's arguments. Owed: one line
naming the flag, exit 2, before any work (simulate --net-bw 0 was a ZeroDivisionError, advise
over a huge range a MemoryError, --slots 0 and --net-bw nan exited 0)."""
from __future__ import annotations

import functools

from benchmarks.faults import registry
from benchmarks.faults.core import TINY, Cmd
from benchmarks.faults.registry import fixture, out_of

case = functools.partial(registry.case, klass="numbers")

SIMULATE = [("--net-bw", "0"), ("--net-bw", "nan"), ("--net-bw", "-5"), ("--net-bw", "inf"), ("--net-bw", "1e400"),
            ("--net-latency-us", "nan"), ("--net-latency-us", "-1"), ("--slots", "0"), ("--slots", "-1"),
            ("--workers", "0"), ("--workers", "1,0,4"), ("--avg-period", "0"), ("--check-every", "0")]
for _flag, _value in SIMULATE:
    @case(f"num-simulate{_flag}={_value}", "53", f"simulate {_flag} {_value}")
    def _(t, flag=_flag, value=_value):
        args = ["simulate", "--compute", fixture(t, "run"), "--out", out_of(t, "sim")]
        args += ["--net-bw", "10"] if flag != "--net-bw" else []
        return [Cmd(args + [flag, value], 2, says=[flag], limit=120)]


ADVISE = [("--workers", "1-100000000000000"), ("--workers", "1,1000000000000"), ("--workers", "0"),
          ("--workers", "-2"), ("--target-loss", "nan"), ("--target-loss", "inf")]
"""1-1e14: the list of worker counts cannot be allocated (MemoryError at once). A range of 1e9 is
left out on purpose: before the fix it allocated gigabytes on a shared machine."""
for _flag, _value in ADVISE:
    @case(f"num-advise{_flag}={_value}", "53", f"advise RUN {_flag} {_value}")
    def _(t, flag=_flag, value=_value):
        return [Cmd(["advise", fixture(t, "run"), "--out", out_of(t, "adv"), flag, value], 2, says=[flag], limit=120)]


SWEEP = [("--threshold", "nan"), ("--threshold", "inf"), ("--threshold", "-1"), ("--target-accuracy", "nan"),
         ("--target-accuracy", "2"), ("--parallel", "0"), ("--slots", "0"), ("--trials", "0"), ("--stale-after", "nan")]
for _flag, _value in SWEEP:
    @case(f"num-sweep{_flag}={_value}", "53", f"sweep {_flag} {_value}")
    def _(t, flag=_flag, value=_value):
        extra = ["--storage", f"sqlite:///{out_of(t, 'study.db')}", "--study", "x"] if flag == "--trials" else []
        return [Cmd(["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
                     "--lr", "0.1,0.2", "--no-report", "--no-progress", *extra, "--out", out_of(t, "s"), flag, value],
                    2, says=[flag], limit=120)]


TRAIN = [("step_size=0", "StepLR"), ("gamma=nan", "StepLR"), ("step_size=-1", "StepLR"),
         ("step_size=1,gamma=inf", "StepLR"), ("T_max=0", "CosineAnnealingLR")]
for _sargs, _sched in TRAIN:
    @case(f"num-scheduler-args-{_sargs}", "53", f"train --scheduler {_sched} --scheduler-args {_sargs}")
    def _(t, sargs=_sargs, sched=_sched):
        extra = ["--scheduler-args", sargs if "step_size" in sargs or sched != "StepLR" else f"step_size=1,{sargs}"]
        return [Cmd(TINY + ["--scheduler", sched, *extra, "--out", out_of(t)], 2, says=["--scheduler-args"],
                    limit=120)]


@case("num-optimizer-args-lr-nan", "53", "train --optimizer Adadelta --optimizer-args lr=nan")
def _(t):
    return [Cmd(TINY + ["--optimizer", "Adadelta", "--optimizer-args", "lr=nan", "--out", out_of(t)], 2,
                says=["--optimizer-args"], limit=120)]
