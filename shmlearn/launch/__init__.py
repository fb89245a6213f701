"""Processes: the launcher's environment, the pool of long-lived workers, the forkserver they fork
from, where a run listens, where its processes go, and the user's script inside a worker."""
