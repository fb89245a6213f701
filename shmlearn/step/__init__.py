"""The fast step in parts: its options (options.py), the kernels each layer runs (kernels.py), the
device step (device.py), CUDA-graph capture (graphs.py), torch.compile (compile.py) and one class
per step mode (modes.py); shmlearn/step/fast.py's Stepper composes them."""
