"""`cmemi logs RUN_DIR [ROLE]`: the services' logs of a run (RUN_DIR/logs/*.log), merged in time order.

Each line is one structlog JSON object; shown as `time  file  level  event  key=value ...` (raw with --json).
Lines that are not JSON (a traceback) are shown as they are, after the line before them. `-f` follows the
files as they grow (new processes' files included) until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from cmemi.shared.runtime.exits import Exit

SKIP = ("timestamp", "level", "event", "service")


def log_files(run_dir: Path, role: str | None) -> list[Path]:
    """The run's log files; ROLE picks `ROLE.log` and `ROLE-*.log` (`worker` is every worker, `worker-w1` one)."""
    files = sorted((run_dir / "logs").glob("*.log"))
    if role:
        files = [f for f in files if f.stem == role or f.stem.startswith(role + "-")]
    return files


def render(line: str, source: str, as_json: bool) -> str:
    if as_json:
        return line
    try:
        rec = json.loads(line)
    except ValueError:
        return f"{'':<8}  {source:<14} {line}"
    if not isinstance(rec, dict):
        return f"{'':<8}  {source:<14} {line}"
    t = str(rec.get("timestamp", ""))[11:23]
    rest = " ".join(f"{k}={_value(v)}" for k, v in rec.items() if k not in SKIP)
    return f"{t:<12}  {source:<14} {str(rec.get('level', '')):<7} {rec.get('event', '')}  {rest}".rstrip()


def _value(v: Any) -> str:
    return v if isinstance(v, str) and " " not in v else json.dumps(v, default=str)


def _key(line: str) -> str:
    try:
        return str(json.loads(line).get("timestamp", ""))
    except (ValueError, AttributeError):
        return ""


def merged(files: list[Path]) -> list[tuple[str, str]]:
    """(source, line) of every file, in timestamp order; a non-JSON line keeps the time of the line before it."""
    rows = []
    for f in files:
        last = ""
        for i, line in enumerate(f.read_text(errors="replace").splitlines()):
            last = _key(line) or last
            rows.append((last, f.stem, i, line))
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return [(src, line) for _, src, _, line in rows]


def follow(run_dir: Path, role: str | None, as_json: bool, out: TextIO, offsets: dict[Path, int],
           interval: float = 0.5) -> None:
    while True:
        time.sleep(interval)
        for f in log_files(run_dir, role):
            start = offsets.get(f, 0)
            with open(f, "rb") as fh:
                fh.seek(start)
                data = fh.read()
            end = data.rfind(b"\n") + 1  # whole lines only; the rest comes with the next read
            offsets[f] = start + end
            for line in data[:end].decode(errors="replace").splitlines():
                print(render(line, f.stem, as_json), file=out, flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cmemi logs", description="The services' logs of a run, in time order.")
    p.add_argument("run_dir", help="the run directory (its logs/ folder holds one file per service process)")
    p.add_argument("role", nargs="?", help="only this role's files: coordinator, aggregator, checkpointer, "
                   "worker (all workers) or worker-ID (one)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the JSON lines as written")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    files = log_files(run_dir, args.role)
    if not files and not args.follow:
        have = sorted(f.stem for f in (run_dir / "logs").glob("*.log"))
        print(f"cmemi: error: no logs{' for ' + repr(args.role) if args.role else ''} in {run_dir / 'logs'}"
              + (f"; have: {', '.join(have)}" if have else "; pass the run directory of a cmemi up run"),
              file=sys.stderr)
        return Exit.FATAL
    offsets = {f: f.stat().st_size for f in files}  # taken first: a line written meanwhile shows twice, not never
    try:
        for source, line in merged(files):
            print(render(line, source, args.json))
        sys.stdout.flush()
        if args.follow:
            follow(run_dir, args.role, args.json, sys.stdout, offsets)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return 0
