"""Benchmarks of CMEMI against plain PyTorch and torchrun DDP (see `make bench`). Each script prints one JSON object."""
