"""The `cmemi` command: `cmemi up CONFIG` for a local cluster, one subcommand per service for separate hosts."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cmemi.commands.configs import bundled_examples, config_path
from cmemi.launcher.launch import SERVICES, exit_code, huge_pages_env, run_service, user_code_importable
from cmemi.shared.runtime.exits import Exit, exit_now

if TYPE_CHECKING:
    from cmemi.launcher.zygote_up import Zygote



def _with_huge_pages(argv: list[str]) -> None:
    """Re-exec this service with glibc's malloc asking for transparent huge pages for its large buffers
    (gradients, parameters, ZeroMQ messages): a fresh 64 MB buffer then takes ~800 page faults instead of
    ~16,000 (30 ms -> 9.5 ms on the benchmark machine). glibc >= 2.35 on Linux (older ones ignore the
    tunable); children inherit it, so this happens once. CMEMI_HUGE_PAGES=0 turns it off."""
    env = huge_pages_env(dict(os.environ))
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "cmemi", *argv], env)


def _up(argv: list[str]) -> int:
    from cmemi.launcher.zygote_up import Zygote

    zygote = Zygote.start() if argv and argv[0] not in ("-h", "--help") else None  # first: its imports overlap ours
    try:
        return _up_with(argv, zygote)
    finally:
        if zygote is not None:
            zygote.stop()


def _up_with(argv: list[str], zygote: Zygote | None) -> int:
    from cmemi.launcher.supervise import RunLock
    from cmemi.shared.config.checks import ConfigError
    from cmemi.shared.config.extras import MissingExtra
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.runtime import startup

    p = argparse.ArgumentParser(prog="cmemi up", description="Run the whole cluster on this machine.")
    p.add_argument("config", help="run config YAML, e.g. examples/digits.yaml, or the name of a bundled example "
                   f"({', '.join(bundled_examples())})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set cluster.workers=3 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue the run in run.dir from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete an earlier run in run.dir and start over")
    p.add_argument("--force-config", action="store_true",
                   help="with --resume: continue with a changed config (by default only fields that change no "
                        "result, e.g. train.steps or cluster.*, may differ)")
    p.add_argument("--verbose", action="store_true",
                   help="print when each process reached each start-up phase, up to the first step")
    args = p.parse_args(argv)
    lock = None
    try:
        cfg = load_config(config_path(args.config), args.set)
        # One `cmemi up` per run directory: a second one is refused at once, before torch is imported
        lock = RunLock(cfg.run.path.resolve())
        if cfg.model.init_from:  # a missing file fails now, in a second, not after the services start
            from cmemi.shared.config.initweights import weights_file

            weights_file(cfg.model.init_from)
        from cmemi.launcher.up import up

        startup.mark("imported")
        if zygote is None:  # with a zygote, it checks them while `cmemi up` starts Redis and the coordinator
            from cmemi.shared.config.plugins import check_plugins

            check_plugins(cfg)
            startup.mark("plugins_checked")
        return up(cfg, resume=args.resume, overwrite=args.overwrite, force_config=args.force_config,
                  verbose=args.verbose, lock=lock, zygote=zygote)
    except (ConfigError, MissingExtra) as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return Exit.FATAL
    finally:
        if lock is not None:
            lock.release()


def _reference(argv: list[str]) -> int:
    from cmemi.launcher.zygote_up import TEMPLATE_ENV, Forked

    template = os.environ.get(TEMPLATE_ENV)  # forked past its imports: cmemi/launcher/zygote_template.py
    if template:
        served = Forked.run(template, ["reference", *argv])
        if isinstance(served, int):
            return served
    from cmemi.commands.reference import main as reference_main

    return reference_main(argv)


def _events(argv: list[str]) -> int:
    from cmemi.commands.events import format_table, load_events, timelines

    p = argparse.ArgumentParser(prog="cmemi events", description="Each fault's recovery timeline, in seconds.")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    try:
        rows = timelines(load_events(args.run_dir))
    except FileNotFoundError as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return Exit.FATAL
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


def _scale(argv: list[str]) -> int:
    from cmemi.shared.coordination.keys import Keys
    from cmemi.shared.coordination.membership import connect

    p = argparse.ArgumentParser(prog="cmemi scale", description="Change the number of workers of a running cluster.")
    p.add_argument("run_dir")
    p.add_argument("workers", type=int)
    args = p.parse_args(argv)
    if args.workers < 1:
        print("cmemi: error: the number of workers must be >= 1", file=sys.stderr)
        return Exit.FATAL
    info = _cluster_info(args.run_dir)
    if info is None:
        return Exit.FATAL
    connect(info["redis"]).set(Keys(info["run"]).scale, args.workers)
    print(f"cmemi: asked run {info['run']!r} for {args.workers} workers")
    return 0


def _cluster_info(run_dir: str) -> dict | None:
    path = Path(run_dir) / "cluster.json"
    if not path.is_file():
        print(f"cmemi: error: {path} not found; pass the run directory of a running `cmemi up`", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def _checkpoints(argv: list[str]) -> int:
    from cmemi.commands.checkpoints import main as checkpoints_main

    return checkpoints_main(argv)


def _status(argv: list[str]) -> int:
    from cmemi.commands.status.cli import main as status_main

    return status_main(argv)


def _dashboard(argv: list[str]) -> int:
    from cmemi.commands.dashboard.cli import main as dashboard_main

    return dashboard_main(argv)


def _plot(argv: list[str]) -> int:
    from cmemi.shared.config.extras import MissingExtra, require

    try:
        require("matplotlib", "plot", "cmemi plot")
    except MissingExtra as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return Exit.FATAL
    from cmemi.commands.plot import main as plot_main

    return plot_main(argv)


def _keys(argv: list[str]) -> int:
    from cmemi.shared.wire.security import ROLE_SECRETS, SecurityError, export_role, generate

    p = argparse.ArgumentParser(prog="cmemi keys", description="Generate the CurveZMQ key pairs of a cluster "
                                "(security.keys_dir): server, aggregator, coordinator, worker.")
    p.add_argument("directory")
    p.add_argument("--workers", type=int, default=0, help="extra worker key pairs worker-0..N-1 (e.g. one per "
                   "host); the shared worker key is always made. Add more later with a new directory: copy its "
                   "worker-*.key files into the servers' directory, no restart needed")
    p.add_argument("--if-missing", action="store_true", help="keep the keys a directory already has")
    p.add_argument("--per-role", metavar="OUT", help="also write OUT/ROLE/ for each role (" + ", ".join(ROLE_SECRETS)
                   + "): the public keys and only that role's secret keys, a complete keys_dir for its containers")
    args = p.parse_args(argv)
    made = generate(Path(args.directory), args.workers, if_missing=args.if_missing)
    if args.per_role:
        try:
            for role in ROLE_SECRETS:
                export_role(Path(args.directory), Path(args.per_role) / role, role)
        except SecurityError as exc:
            print(f"cmemi: error: {exc}", file=sys.stderr)
            return Exit.FATAL
        print(f"wrote {len(made)} files to {args.directory} (every role's keys: keep them off the hosts) and "
              f"{args.per_role}/{{{','.join(ROLE_SECRETS)}}}/: the public keys and only that role's secret keys (mode "
              "600). Give each role's hosts or containers only its own directory, as their security.keys_dir.")
        return 0
    print(f"wrote {len(made)} files to {args.directory} (secret keys mode 600). In the config of every service:\n"
          f"security:\n  curve: true\n  keys_dir: {Path(args.directory).resolve()}\n"
          "Each host needs the public *.key files and only its own role's *.key_secret: the aggregator host "
          "server + aggregator, the checkpointer host server, the coordinator host coordinator, worker hosts "
          "worker (or worker-N); `--per-role OUT` writes one such directory per role.")
    return 0


def _logs(argv: list[str]) -> int:
    from cmemi.commands.logs import main as logs_main

    return logs_main(argv)


COMMANDS = {"up": _up, "reference": _reference, "events": _events, "scale": _scale, "checkpoints": _checkpoints, "status": _status,
            "dashboard": _dashboard, "plot": _plot, "keys": _keys, "logs": _logs}


def main(argv: list[str] | None = None) -> None:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: cmemi {up,reference,events,scale,checkpoints,status,dashboard,plot,keys,logs,aggregator,worker,checkpointer,coordinator} ...\n\n"
              "  up CONFIG        run the whole cluster on this machine\n"
              "  reference CONFIG train it in one process as the cluster would; prints params_sha256\n"
              "  events RUN_DIR   each fault's recovery timeline\n"
              "  scale RUN_DIR N  add or remove workers of a running cluster\n"
              "  status RUN_DIR [--watch] [--json]\n"
              "                   what a run is doing now (step, loss, workers, events)\n"
              "  dashboard RUN_DIR [--host H] [--port P]\n"
              "                   a live page of the run in the browser (curves, workers, events)\n"
              "  plot RUN_DIR [-o out.png]\n"
              "                   loss, eval, lr and throughput over time, faults marked\n"
              "  keys DIR [--per-role OUT]\n                   generate CurveZMQ key pairs (security.curve), one dir per role\n"
              "  logs RUN_DIR [ROLE] [-f]\n"
              "                   the services' logs of a run (RUN_DIR/logs/), in time order\n"
              "  checkpoints list|verify|export RUN_DIR\n"
              "                   inspect, check and export checkpoints\n"
              "  aggregator|worker|checkpointer|coordinator --config ...  (Redis URL in $CMEMI_REDIS_URL)\n"
              "                   run one service alone (separate hosts)\n")
        sys.exit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    user_code_importable()
    if cmd in SERVICES:
        if from_command_line:
            _with_huge_pages(argv)
            exit_now(exit_code(lambda: run_service(cmd, rest)))
        run_service(cmd, rest)
        return
    if cmd == "zygote":  # started by `cmemi up` only (cmemi/launcher/zygote.py)
        if from_command_line:
            _with_huge_pages(argv)
        from cmemi.launcher.zygote import main as zygote_main

        sys.exit(zygote_main(rest))
    if cmd == "zygote-template":  # a warm zygote for many runs (cmemi/launcher/zygote_template.py): tests, sweeps
        if from_command_line:
            _with_huge_pages(argv)
        from cmemi.launcher.zygote_template import main as template_main

        sys.exit(template_main(rest))
    if cmd not in COMMANDS:
        print(f"cmemi: unknown command {cmd!r}; choose one of: {', '.join([*COMMANDS, *SERVICES])}", file=sys.stderr)
        sys.exit(Exit.FATAL)
    if cmd == "up" and from_command_line:
        exit_now(exit_code(lambda: COMMANDS[cmd](rest)))
    sys.exit(COMMANDS[cmd](rest))
