"""Sweeps on an Optuna study (`shmlearn sweep --storage URL --study NAME`): the driver, the
book of trials one process sees, the search space and pruners, and the storages."""
