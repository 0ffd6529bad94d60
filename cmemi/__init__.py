"""CMEMI: fault-tolerant, deterministic data-parallel PyTorch training on a small cluster.

- `__main__.py`: `python -m cmemi`, the same as the `cmemi` command.
- `cli.py`: the `cmemi` command: `cmemi up CONFIG` for a local cluster, one subcommand per service for separate hosts.
- `commands/`: the read-only and one-process subcommands (status, logs, events, plot, checkpoints, reference).
- `launcher/`: `cmemi up`: Redis, the coordinator, the zygote that forks every service, the supervision and the end.
"""

__version__ = "0.1.0"
