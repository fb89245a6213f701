"""Many runs: the paper's grid sweep, the trial runner, the results file, the winner rule and how
sure its verdicts are, exact pruning, and sweeps on an Optuna study (study/)."""
