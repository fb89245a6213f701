"""The CLI's main() run in the test process, for refusals: a fresh interpreter apiece is 2-5 s
of imports on two cores. The tests that train, kill or resume runs still run the program."""
import os
import subprocess

LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC")


def run_main(args, monkeypatch, capfd, *, tag=None) -> subprocess.CompletedProcess:
    """(args, exit code, stdout, stderr) as the program's CompletedProcess would hold them.

    stderr is read from fd 2, so what any process the run started wrote there counts as it did
    from the program. A launcher's variables are cleared (the test process may itself run under
    one). tag: SHMLEARN_TEST_TAG for what the run starts (test_reliability's processes_with_tag);
    multiprocessing's resource tracker, which spawned workers share and which outlives the run in
    this process (in the program's own it ends with it), is started first, untagged, so it is not
    counted as a process the run left behind."""
    from multiprocessing import resource_tracker

    from shmlearn.cli.main import main
    resource_tracker.ensure_running()
    for k in list(os.environ):
        if k.startswith(LAUNCHER_PREFIXES) or k in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)
    if tag is not None:
        monkeypatch.setenv("SHMLEARN_TEST_TAG", tag)
    monkeypatch.delenv("SHMLEARN_FAULT", raising=False)
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)
