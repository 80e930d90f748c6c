"""The benchmark harness: one torchrun DLRM job (`benchmarks/train_dlrm.py`) with every algorithm and baseline."""
