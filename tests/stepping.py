"""The training loop's protocol for tests that drive a Stepper directly (tests/ is on pytest's
pythonpath): test_fast.py and step/test_user_optimizers.py."""


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
