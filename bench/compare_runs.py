"""Two commits' runs of one benchmark, side by side: the median of each figure over the runs, and head / base.

A change that must not slow the hot path (a refactor) is measured by running the same benchmark alternately in a
checkout of the base commit and of the head, alone on the machine, then comparing here; alternating spreads the
machine's drift over both. Each input is a results file of that benchmark (it records the commit it measured):

    .venv/bin/python bench/compare_runs.py --base b1.json b2.json --head h1.json h2.json \\
        --key ms_per_step --out bench/results/NAME.json

`--key` names the dict of figures to compare (nested dicts are flattened to `a.b` names); lower is better for
times, so a ratio above 1 is the head being slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def flat(d: Any, prefix: str = "") -> dict[str, float]:
    """{"a": {"b": 1.0}} -> {"a.b": 1.0}: numbers only."""
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        return {prefix: float(d)}
    if isinstance(d, dict):
        return {k: v for key, sub in d.items() for k, v in flat(sub, f"{prefix}.{key}" if prefix else key).items()}
    return {}


def side(files: list[str], key: str) -> tuple[list[str], dict[str, float], dict[str, list[float]]]:
    """The commits measured, the median of each figure, and every run's figures."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    commits = sorted({str(r.get("commit")) for r in runs})
    figures: dict[str, list[float]] = {}
    for r in runs:
        for name, value in flat(r.get(key, {})).items():
            figures.setdefault(name, []).append(value)
    return commits, {n: round(statistics.median(v), 3) for n, v in figures.items()}, figures


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", nargs="+", required=True, help="the base commit's results files")
    p.add_argument("--head", nargs="+", required=True, help="the head commit's results files")
    p.add_argument("--key", required=True, help="the results' dict of figures to compare, e.g. ms_per_step")
    p.add_argument("--note", default="", help="how the runs were made (the command, alone on the machine?)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    base_commits, base, base_runs = side(args.base, args.key)
    head_commits, head, head_runs = side(args.head, args.key)
    runs = [json.loads(Path(f).read_text()) for f in args.head]
    result = {"bench": "compare_runs", "commit": runs[0].get("commit"), "dirty": runs[0].get("dirty"),
              "date": runs[0].get("date"), "key": args.key, "note": args.note,
              "base": {"commits": base_commits, "runs": len(args.base), "median": base, "all": base_runs},
              "head": {"commits": head_commits, "runs": len(args.head), "median": head, "all": head_runs},
              "head_over_base": {n: round(head[n] / base[n], 3) for n in base if n in head and base[n]}}
    text = json.dumps(result, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
