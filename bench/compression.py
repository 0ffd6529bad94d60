"""Every gradient codec on the digits example (and the char-level LM), same steps: bytes vs accuracy.

    .venv/bin/python bench/compression.py [--quick] [--examples digits,charlm]

Prints one JSON object: per example, per codec: bytes sent per step, ratio to `none`, final eval
metric, median encode+decode seconds per step (workers' encode + aggregator's decode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODECS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
EXAMPLES = {
    "digits": {"config": "examples/digits.yaml", "metric": "accuracy", "sets": []},
    "charlm": {"config": "examples/charlm.yaml", "metric": "loss", "sets": []},
}


def run(example: str, codec: str, workdir: Path, extra: list[str]) -> dict:
    spec = EXAMPLES[example]
    run_dir = workdir / f"{example}-{codec}"
    cmd = [sys.executable, "-m", "cmemi", "up", spec["config"], "--set", f"run.dir={run_dir}",
           "--set", f"run.name=bench-{example}-{codec}", "--set", f"compression.codec={codec}",
           "--set", "cluster.spare_workers=0", "--set", "checkpoint.every_steps=0", *spec["sets"], *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"codec": codec, "error": proc.stderr.strip().splitlines()[-1:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "codec": codec,
        "bytes_sent_per_step": summary["bytes_sent"] / summary["steps"],
        "bytes_received_per_step": summary["bytes_received"] / summary["steps"],
        f"eval_{spec['metric']}": summary["eval"].get(spec["metric"]),
        "final_loss": summary["final_loss"],
        "codec_s_per_step_median": statistics.median(m["codec_s"] for m in metrics),
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="digits only")
    ap.add_argument("--examples", default=None, help="comma-separated: digits,charlm")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run")
    args = ap.parse_args()
    examples = args.examples.split(",") if args.examples else (["digits"] if args.quick else list(EXAMPLES))
    out: dict = {"bench": "compression", "examples": {}}
    with tempfile.TemporaryDirectory(prefix="cmemi-bench-") as tmp:
        for ex in examples:
            rows = []
            for codec in CODECS:
                print(f"[compression] {ex} {codec}", file=sys.stderr, flush=True)
                rows.append(run(ex, codec, Path(tmp), args.set))
            base = next((r for r in rows if r["codec"] == "none" and "error" not in r), None)
            for r in rows:
                if base and "error" not in r:
                    r["ratio_vs_none"] = base["bytes_sent_per_step"] / r["bytes_sent_per_step"]
            out["examples"][ex] = rows
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
