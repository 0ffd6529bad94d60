"""The `cmemi` command: `cmemi up CONFIG` for a local cluster, one subcommand per service for separate hosts."""

from __future__ import annotations

import argparse
import sys

SERVICES = ("aggregator", "worker", "checkpointer", "coordinator")


def _up(argv: list[str]) -> int:
    from cmemi.up import up
    from shared.config import ConfigError, load_config
    from shared.plugins import check_plugins

    p = argparse.ArgumentParser(prog="cmemi up", description="Run the whole cluster on this machine.")
    p.add_argument("config", help="run config YAML, e.g. examples/digits.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set cluster.workers=3 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue the run in run.dir from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete an earlier run in run.dir and start over")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        check_plugins(cfg)
        return up(cfg, resume=args.resume, overwrite=args.overwrite)
    except ConfigError as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return 2


COMMANDS = {"up": _up}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: cmemi {up,aggregator,worker,checkpointer,coordinator} ...\n\n"
              "  up CONFIG        run the whole cluster on this machine\n"
              "  aggregator|worker|checkpointer|coordinator --config ... --redis URL\n"
              "                   run one service alone (separate hosts)\n")
        sys.exit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd in SERVICES:
        import importlib
        importlib.import_module(f"services.{cmd}.__main__").main(rest)
        return
    if cmd not in COMMANDS:
        print(f"cmemi: unknown command {cmd!r}; choose one of: {', '.join([*COMMANDS, *SERVICES])}", file=sys.stderr)
        sys.exit(2)
    sys.exit(COMMANDS[cmd](rest))
