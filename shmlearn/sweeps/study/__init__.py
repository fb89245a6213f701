"""Sweeps on an Optuna study (`shmlearn sweep --storage URL --study NAME`): the driver, the
book of trials one process sees, the search space and pruners, the pruning one process drives
(eval points reported, bounds posted), and the storages."""
