"""The fault campaign (benchmarks/fault_campaign.py runs it), one module per class of cases:

    issue15, issue38   the earlier rounds: stopped, hung and killed ranks and launchers, kills
                       mid-checkpoint, dying trials, unusable data, extreme values, studies
    symlinks           symlinks in --out pointing out of it (writes must not follow them)
    environ            the launcher's environment (torchrun, Open MPI, Slurm variables)
    readback           corrupt files read back: run and sweep files, checkpoints, model.pt
    yamltypes          a --config value of the wrong type, per field, and YAML 1.1's booleans
    interrupts         Ctrl-C at every phase (and twice), SIGHUP
    pipes              stdout closed by its reader (`| head -1`, `| true`)
    imports            user files that fail, or never return, at import
    diskfull           a full disk (RLIMIT_FSIZE) and unwritable outputs
    numbers            numbers out of range: simulate, advise, sweep thresholds
    usercode           the newcomer: resume of a finished run, a `shmlearn/` folder in the cwd,
                       the API from stdin, scripts and losses that misbehave

registry.CASES holds them once load_all() has imported every module.
"""
import importlib

CLASSES = ("issue15", "issue38", "symlinks", "environ", "readback", "yamltypes", "interrupts", "pipes",
           "imports", "diskfull", "numbers", "usercode")


def load_all() -> None:
    for name in CLASSES:
        importlib.import_module(f"benchmarks.faults.{name}")
