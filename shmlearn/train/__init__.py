"""One training run: the entry that checks and launches it, the loop every strategy shares, its
inputs, evaluation, checkpoints, the rank guard and the gradient-noise measurement."""
