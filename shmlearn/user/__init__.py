"""The user's own parts: a model, data or loss by registered name or by reference (FILE.py:NAME),
the user's optimizer, scheduler and loss (the recipe), the optimizer registry and the tasks; and the
user's script, which a pool worker imports up to its shmlearn.train call (user_main.py)."""
