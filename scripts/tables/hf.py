"""The Hugging Face example's loss going down (bench/hf_lm.py's bench/results/hf_lm.json), for
docs/guides/hugging-face.md."""

from __future__ import annotations

from scripts.tables import provenance
from scripts.tables.provenance import load, measured

WINDOW = 10  # training loss: the mean of the steps ending at the row's step (one step's loss is noisy)


def hf_lm() -> str:
    """Training and held-out loss of examples/hf_lm.yaml at a few steps, and whether `cmemi up` = `cmemi reference`."""
    if not (provenance.RESULTS / "hf_lm.json").is_file():
        return "No results yet: bench/hf_lm.py with --out writes them (the command is above)."
    d = load("hf_lm")
    loss, evals = d["loss"], {e["step"]: e for e in d["eval"]}
    evals[d["steps"]] = {"step": d["steps"], **d["final_eval"]}
    rows = sorted({1, *evals})
    lines = [f"`cmemi up {d['config']}` ({d['workers']} workers, {d['steps']} steps, `--set "
             f"{' --set '.join(d['sets'])}`), measured with `{d['command']}`: training loss (mean of the {WINDOW} steps "
             "ending at the step; step 1 alone) and held-out loss (nats per token) and perplexity. "
             f"`cmemi reference` of the same config ended with the {'same' if d['equal'] else 'DIFFERENT'} "
             f"params_sha256 (`{d['params_sha256']['up'][:16]}…`).", "",
             "| step | training loss | held-out loss | held-out perplexity |", "|---|---|---|---|"]
    for step in rows:
        window = loss[max(0, step - WINDOW):step] if step > 1 else loss[:1]
        train = sum(window) / len(window)
        e = evals.get(step)
        held = f"{e['loss']:.3f} | {e['perplexity']:.1f}" if e else "– | –"
        lines.append(f"| {step} | {train:.3f} | {held} |")
    lines += ["", measured("hf_lm")]
    return "\n".join(lines)
