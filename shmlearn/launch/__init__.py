"""Processes: the launcher's environment, the pool of long-lived workers and the watchdog of their
jobs, the forkserver they fork from, where a run listens and where its processes go."""
