"""The training loop's protocol for tests that drive a Stepper directly (tests/ is on pytest's
pythonpath): test_fast.py and step/test_user_optimizers.py; and the plain single-process loop that
the user-recipe tests compare with (step/, user/test_recipe.py)."""


def run_steps(st, steps):
    """The loop's protocol: run, read when due, update (classic) unless the read found a NaN.
    Returns the window that found a NaN, or None."""
    for step in range(steps):
        st.run(step)
        if st.due(step + 1) or step + 1 == steps:
            win = st.read(step + 1)
            if win.bad is not None:
                return win
            st.update()
    return None


def nll(out, y):
    """The loss the user-recipe tests pass (log-softmax and NLL, written out)."""
    import torch.nn.functional as F
    return F.nll_loss(F.log_softmax(out, dim=1), y)


def flat(model):
    """The model's parameters in one vector (what the tests compare)."""
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def plain_loop(make, steps, batch, hook=None, scheduler=None):
    """What a user writes without shmlearn: one process, torch only, the mlp on digits (seed 0)
    with the optimizer make(model) (and its step pre-hook, and scheduler(optimizer) stepped after
    every step), on the loader's batches of `batch` samples: a pure function of seed and step, so
    the W workers' batches of a step concatenated are this batch. Returns the final weights."""
    import torch

    from shmlearn.data import load_dataset, normalizer
    from shmlearn.data.loader import ShardedLoader
    from shmlearn.models import build_model
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", data.spec)
    optimizer = make(model)
    if hook is not None:
        optimizer.register_step_pre_hook(hook)
    sched = scheduler(optimizer) if scheduler is not None else None
    loader = ShardedLoader(data.train_x, data.train_y, batch_size=batch, shard=0, num_shards=1, seed=0,
                           normalize=normalizer(data, torch.device("cpu")))
    for step in range(steps):
        x, y = loader.batch(step)
        optimizer.zero_grad()
        nll(model(x), y).backward()
        optimizer.step()
        if sched is not None:
            sched.step()
    return flat(model)
