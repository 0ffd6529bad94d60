"""The Hugging Face example's loss curve: `cmemi up examples/hf_lm.yaml` as it ships (a GPT-2 built by
`transformers`, 2 workers, 200 steps), with a held-out evaluation every 50 steps, and `cmemi reference` of the
same config, whose params_sha256 must be the run's (docs/guides/hugging-face.md quotes this file's table).

    .venv/bin/python bench/hf_lm.py [--out bench/results/hf_lm.json]

Prints one JSON object: the training loss of every step, the evaluations, both params_sha256. Needs cmemi[hf];
nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402

CONFIG = "examples/hf_lm.yaml"
SETS = ("eval.every_steps=50",)


def run(argv: list[str], work: Path, name: str, timeout: float) -> None:
    """One cmemi command in its own process group, its output in WORK/NAME.log; raises when it fails."""
    group = C.ProcGroup([C.PY, "-m", "cmemi", *argv], log_path=work / f"{name}.log",
                        env_=C.env(HF_HUB_OFFLINE="1", HF_HOME=str(work / "hf-home")))
    rc = group.wait(timeout)
    group.stop()
    if rc != 0:
        raise RuntimeError(f"cmemi {argv[0]} exited {rc}: {group.tail()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the JSON here, e.g. bench/results/hf_lm.json")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    C.setup()
    t0 = time.monotonic()
    work = C.workdir("hf_lm", args.keep)
    sets = [a for s in SETS for a in ("--set", s)]
    result: dict[str, Any] = {"bench": "hf_lm", **C.provenance(), "machine": C.machine(),
                              "command": "python bench/hf_lm.py", "config": CONFIG, "sets": list(SETS)}
    try:
        run_dir = work / "run"
        run(["up", CONFIG, *sets, "--set", f"run.dir={run_dir}", "--set", f"run.name={C.safe_name('hf_lm')}"],
            work, "up", timeout=1200)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run_dir / "summary.json").read_text())
        run(["reference", CONFIG, *sets, "--out", str(work / "reference.json")], work, "reference", timeout=1200)
        reference = json.loads((work / "reference.json").read_text())
        result.update({
            "workers": summary.get("workers", 2), "steps": summary["steps"],
            "loss": [C.rnd(m["loss"], 5) for m in metrics if "loss" in m],
            "eval": [{"step": e["step"], **C.rnd(e["eval"], 5)} for e in reference["eval_history"]],
            "final_eval": {k: C.rnd(v, 5) for k, v in summary["eval"].items()},
            "params_sha256": {"up": summary["params_sha256"], "reference": reference["params_sha256"]},
            "equal": summary["params_sha256"] == reference["params_sha256"],
            "wall_s": {"up": C.rnd(summary["wall_s"], 1), "reference": C.rnd(reference["wall_s"], 1)},
        })
    except BaseException as exc:
        C.record_error(result, exc)
    C.finish(result, work, args.keep, t0)
    if args.out and "error" not in result:
        Path(args.out).write_text(json.dumps(result, indent=1, default=C.jsonable) + "\n")


if __name__ == "__main__":
    main()
