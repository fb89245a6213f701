"""Predictions from measurements: `shmlearn simulate` (step time at 1..1024 workers, simulate/) and
`shmlearn advise` (workers and batch from the gradient noise scale)."""
