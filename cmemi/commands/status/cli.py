"""`cmemi status RUN_DIR`: what a run is doing now, read from its Redis (or from its files once it ended).

`--json` prints the same report as one JSON object (one per line with `--watch`). Everything here is read-only:
status never writes to Redis or to the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from cmemi.commands.status.render import render
from cmemi.commands.status.report import collect
from cmemi.commands.status.target import StatusError, Target
from cmemi.commands.status.values import FINAL_STATES
from cmemi.shared.runtime.exits import Exit


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cmemi status", description="What a run is doing now (read from its Redis).")
    p.add_argument("run_dir", nargs="?", help="the run directory (its cluster.json names the Redis)")
    p.add_argument("--redis", default=None, metavar="URL", help="Redis URL of a cluster started another way")
    p.add_argument("--run", default=None, metavar="NAME", help="the run name (run.name) with --redis")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds until the run ends")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--events", type=int, default=8, metavar="N", help="how many recent events to show")
    p.add_argument("--json", action="store_true", help="print the report as JSON (one object per line with --watch)")
    args = p.parse_args(argv)
    if args.run_dir is None and args.redis is None:
        p.error("pass RUN_DIR, or --redis URL --run NAME")
    try:
        target = Target(args.run_dir, args.redis, args.run)
        if not args.watch:
            _show(collect(target, args.events), args.json, clear=False)
            return 0
        clear = sys.stdout.isatty() and not args.json
        while True:
            report = collect(target, args.events)
            _show(report, args.json, clear)
            if report["source"] != "redis" or report["state"] in FINAL_STATES:
                return 0
            time.sleep(max(0.1, args.interval))
    except StatusError as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return Exit.FATAL
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `cmemi status --watch | head`: the reader is gone
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 0


def _show(report: dict[str, Any], as_json: bool, clear: bool) -> None:
    if as_json:
        print(json.dumps(report, default=str), flush=True)
        return
    text = render(report)
    if clear:
        sys.stdout.write("\x1b[H\x1b[2J")
    print(text + ("" if clear else "\n"), flush=True)
