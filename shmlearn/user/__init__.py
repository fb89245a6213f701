"""The user's own parts: a model, data or loss by registered name or by reference (FILE.py:NAME),
the user's optimizer, scheduler and loss (the recipe), the optimizer registry and the tasks."""
