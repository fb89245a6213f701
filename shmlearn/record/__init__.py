"""What a run leaves on disk and how it is read back: the run directory, summary, timing, metrics
files (JSON lines), TensorBoard events, the trained weights, and the one writer and the one
reader of every file."""
