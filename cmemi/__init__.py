"""CMEMI: fault-tolerant, deterministic data-parallel PyTorch training on a small cluster."""

__version__ = "0.1.0"
