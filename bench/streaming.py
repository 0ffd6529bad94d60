"""Streaming DiLoCo (`train.fragments`) against whole rounds and synchronous training: eval loss at equal samples and
bytes per sample, on `examples/charlm.yaml`.

    .venv/bin/python bench/streaming.py [--steps 2000] [--jobs 2] [--out FILE]

Each row trains `--steps` inner steps' worth of samples (R = 4 replicas, the default outer step) twice: `cmemi reference`
(its eval loss: the algorithm the cluster runs) and `cmemi up` with 2 workers on this machine (its `summary.json`:
every byte workers sent and received, per sample trained, and its params_sha256, which must be the reference's). The
rows: synchronous steps; whole rounds of H = 50 and of H = 10 (a round as often as a fragment's sync at F = 5);
H = 50 in F = 5 fragments (a server step every 10 inner steps, one fragment synced each). Prints one JSON object;
`--out PATH` saves it too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common as C  # noqa: E402

CONFIG = "examples/charlm.yaml"
ROWS = {"synchronous": (0, 1), "H=50": (50, 1), "H=50, F=5": (50, 5), "H=10": (10, 1)}


def sets(steps: int, local: int, fragments: int) -> list[str]:
    out = [f"train.steps={steps}", f"scheduler.kwargs.total_steps={steps}", "checkpoint.every_steps=0",
           "cluster.spare_workers=0", "cluster.workers=2"]
    if local:
        out += [f"train.local_steps={local}", "train.replicas=4", f"train.fragments={fragments}"]
    return out


def cmemi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cmemi", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)


def row(name: str, steps: int, tmp: Path) -> dict:
    local, fragments = ROWS[name]
    s = sets(steps, local, fragments)
    argv = [a for x in s for a in ("--set", x)]
    out = tmp / f"{name.replace(' ', '').replace(',', '-').replace('=', '')}"
    ref = cmemi("reference", CONFIG, *argv, "--out", f"{out}-ref.json")
    if ref.returncode != 0:
        return {"name": name, "error": ref.stderr.strip().splitlines()[-1:]}
    up = cmemi("up", CONFIG, *argv, "--set", f"run.dir={out}-run")
    if up.returncode != 0:
        return {"name": name, "error": up.stderr.strip().splitlines()[-1:]}
    r = json.loads(Path(f"{out}-ref.json").read_text())
    summary = json.loads((Path(f"{out}-run") / "summary.json").read_text())
    samples = steps * 32  # charlm's global_batch: every row trains the same samples
    return {"name": name, "local_steps": local, "fragments": fragments, "server_steps": summary["steps"],
            "eval_loss": r["eval"]["loss"], "bytes_per_sample": (summary["bytes_sent"] + summary["bytes_received"])
            / samples, "bytes_sent": summary["bytes_sent"], "bytes_received": summary["bytes_received"],
            "inner_states_sent": summary.get("inner_states_sent"),
            "params_sha256_equal_reference": summary["params_sha256"] == r["params_sha256"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="inner steps' worth of samples per row (default 2000)")
    p.add_argument("--jobs", type=int, default=1, help="rows at once")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = {"bench": "streaming", **C.provenance(), "machine": C.machine(), "config": CONFIG, "steps": args.steps,
           "command": " ".join([".venv/bin/python", "bench/streaming.py", *sys.argv[1:]])}
    with tempfile.TemporaryDirectory(prefix="cmemi-streaming-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        out["rows"] = list(pool.map(lambda name: row(name, args.steps, Path(tmp)), ROWS))
    C.emit_result(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
