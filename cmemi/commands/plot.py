"""`cmemi plot RUN_DIR [-o out.png]`: loss, eval, learning rate and throughput of a run, faults marked.

Reads RUN_DIR/metrics.jsonl (step lines; lines with an `eval` dict are evaluations), summary.json (the
final evaluation, drawn as a marker when metrics.jsonl has no evaluations) and events.jsonl (deaths,
restarts, fences, aggregator restarts, checkpoint restores and injected faults: vertical lines).
Works on a finished run and on one still running (what has been written so far).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display

import matplotlib.pyplot as plt  # noqa: E402  (after the backend choice)
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from cmemi.shared.runtime.exits import Exit

# event kind -> (colour, line style) of its vertical line
FAULT_KINDS: dict[str, tuple[str, str]] = {
    "fault_injected": ("black", ":"),
    "died": ("tab:red", "-"),
    "fenced": ("tab:orange", "--"),
    "restarted": ("tab:green", "-."),
    "aggregator_started": ("tab:purple", "--"),
    "checkpoint_restored": ("tab:brown", ":"),
}


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a partial last line of a running run
        if isinstance(row, dict):
            out.append(row)
    return out


def load_run(run_dir: str | Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    metrics = _rows(run_dir / "metrics.jsonl")
    if not metrics:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} not found or empty; pass the run directory of a "
                                "`cmemi up` run that has trained at least one step")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    events = sorted((e for e in _rows(run_dir / "events.jsonl") if "kind" in e and "t" in e), key=lambda e: e["t"])
    return {"run_dir": run_dir, "metrics": metrics, "summary": summary, "events": events}


def _window(n: int) -> int:
    """Steps in the moving mean: about a tenth of the run, 1 (none) for short runs, at most 25."""
    return max(1, min(25, n // 10))


def _segments(steps: list[dict[str, Any]]) -> list[slice]:
    """Runs of consecutive training: a new one starts where the step goes back (an aggregator restored a
    checkpoint) or where no step was logged for a long while (nothing trained: a restart in progress)."""
    if not steps:
        return []
    dts = sorted(float(r.get("step_time_s") or 0.0) for r in steps)
    gap = max(1.0, 20 * dts[len(dts) // 2])
    cuts = [0]
    for i in range(1, len(steps)):
        back = steps[i]["step"] <= steps[i - 1]["step"]
        stalled = "t" in steps[i] and "t" in steps[i - 1] and steps[i]["t"] - steps[i - 1]["t"] > gap
        if back or stalled:
            cuts.append(i)
    cuts.append(len(steps))
    return [slice(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def _joined(xs: np.ndarray, ys: np.ndarray, segs: list[slice], window: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One polyline for all segments (NaN between them, so matplotlib breaks the line), each segment
    smoothed by a moving mean of `window` points (segments shorter than that are left out)."""
    out_x: list[np.ndarray] = []
    out_y: list[np.ndarray] = []
    for seg in segs:
        x, y = xs[seg], ys[seg]
        if window > 1:
            if len(y) < window:
                continue
            x, y = x[window - 1:], np.convolve(y, np.ones(window) / window, mode="valid")
        out_x += [x, np.array([np.nan])]
        out_y += [y, np.array([np.nan])]
    if not out_x:
        return np.array([]), np.array([])
    return np.concatenate(out_x[:-1]), np.concatenate(out_y[:-1])


def _label(e: dict[str, Any]) -> str:
    if e["kind"] == "aggregator_started":
        return f"aggregator back (step {e.get('step', '?')})"
    who = f"{e.get('role', '')} {e.get('id') or e.get('worker') or ''}".strip()
    return f"{'killed' if e['kind'] == 'fault_injected' else 'died'}: {who}"


def build_figure(run_dir: str | Path, x: str = "time") -> tuple[Figure, set[str]]:
    """The figure of a run and the names of the series drawn on it.

    x: "time" (seconds since training began) or "step". Series names: loss, eval (plus eval:<metric>
    for each metric drawn), lr, samples_per_s, and faults when fault lines are drawn.
    """
    if x not in ("time", "step"):
        raise ValueError(f"x must be 'time' or 'step', not {x!r}")
    run = load_run(run_dir)
    steps = [r for r in run["metrics"] if isinstance(r.get("loss"), (int, float)) and "step" in r]
    evals = [r for r in run["metrics"] if isinstance(r.get("eval"), dict) and "step" in r]
    have_time = bool(steps) and all("t" in r for r in steps)
    if x == "time" and not have_time:
        x = "step"  # metrics written before wall times were logged
    starts = [e["t"] for e in run["events"] if e["kind"] == "aggregator_started"]
    t0 = min([steps[0]["t"] - (steps[0].get("step_time_s") or 0.0)] + starts[:1]) if have_time else 0.0
    step_t = np.array([r["t"] for r in steps], dtype=float) if have_time else np.array([])
    step_s = np.array([r["step"] for r in steps], dtype=float)

    def xs_of(rows: list[dict[str, Any]]) -> np.ndarray:
        if x == "step":
            return np.array([r["step"] for r in rows], dtype=float)
        return np.array([r.get("t", np.nan) for r in rows], dtype=float) - t0

    def eval_xs(rows: list[dict[str, Any]]) -> np.ndarray:
        """An evaluation is logged when it finishes (in the background, later); draw it where its step was trained:
        the last time that step was logged before the evaluation was."""
        if x == "step":
            return xs_of(rows)
        times: dict[int, list[float]] = {}
        for s in steps:
            times.setdefault(s["step"], []).append(s["t"])
        out = []
        for r in rows:
            trained = [t for t in times.get(r["step"], []) if t <= r.get("t", np.inf)]
            out.append((trained[-1] if trained else r.get("t", np.nan)) - t0)
        return np.array(out, dtype=float)

    def x_of_time(t: float) -> float:
        if x == "time":
            return t - t0
        return float(np.interp(t, step_t, step_s)) if len(step_t) else float("nan")

    def y_of(key: str) -> np.ndarray:
        return np.array([r[key] if isinstance(r.get(key), (int, float)) else np.nan for r in steps], dtype=float)

    series: set[str] = set()
    fig, axes = plt.subplots(4, 1, figsize=(10, 10.5), sharex=True, layout="constrained")
    ax_loss, ax_eval, ax_lr, ax_tput = axes
    name = Path(run["run_dir"]).resolve().name
    total = (run["summary"] or {}).get("steps") or (steps[-1]["step"] if steps else 0)
    fig.suptitle(f"cmemi run {name}: {total} steps", fontsize=13)
    xs, segs, window = xs_of(steps), _segments(steps), _window(len(steps))

    def draw(ax: Any, key: str, color: str, label: str, gid: str, smooth: bool = True) -> None:
        ys = y_of(key)
        if smooth and window > 1:
            ax.plot(*_joined(xs, ys, segs), color=color, lw=0.6, alpha=0.35, label=f"{label} (per step)", gid=gid)
            ax.plot(*_joined(xs, ys, segs, window), color=color, lw=1.6, label=f"{label} (mean of {window} steps)",
                    gid=f"{gid}:smooth")
        else:
            ax.plot(*_joined(xs, ys, segs), color=color, lw=1.2, label=label, gid=gid)
        series.add(gid)

    if steps:
        draw(ax_loss, "loss", "tab:blue", "train loss", "loss")
        losses = y_of("loss")
        if np.nanmin(losses) > 0 and np.nanmax(losses) / np.nanmin(losses) > 50:
            ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")

    for k in sorted({k for r in evals for k in r["eval"]}):
        pts = [r for r in evals if isinstance(r["eval"].get(k), (int, float))]
        (ax_loss if k == "loss" else ax_eval).plot(
            eval_xs(pts), [r["eval"][k] for r in pts], marker="o", ms=4, lw=1.2,
            color="tab:red" if k == "loss" else None, label=f"eval {k}", gid=f"eval:{k}")
        series.update({"eval", f"eval:{k}"})
    final_eval = (run["summary"] or {}).get("eval") or {}
    x_end = float(xs[-1]) if len(xs) else 0.0
    if have_time and x == "time" and run["summary"] is not None:
        done = next((e["t"] for e in reversed(run["events"]) if e["kind"] == "run_completed"), None)
        x_end = done - t0 if done is not None else x_end
    for k, v in final_eval.items():
        if isinstance(v, (int, float)):
            (ax_loss if k == "loss" else ax_eval).plot(
                [x_end], [v], marker="*", ms=14, ls="none", color="tab:red" if k == "loss" else "tab:blue",
                label=f"final eval {k} = {v:.4g}", gid=f"eval:{k}:final")
            series.update({"eval", f"eval:{k}"})
    ax_eval.set_ylabel("eval metric")
    if "eval" not in series:
        ax_eval.text(0.5, 0.5, "no evaluation (set eval.fn)", transform=ax_eval.transAxes, ha="center",
                     va="center", color="grey")

    if steps and np.isfinite(y_of("lr")).any():
        draw(ax_lr, "lr", "tab:green", "learning rate", "lr", smooth=False)
    ax_lr.set_ylabel("learning rate")

    tput = y_of("samples_per_s")
    if steps and np.isfinite(tput).any():
        draw(ax_tput, "samples_per_s", "tab:orange", "samples/s", "samples_per_s")
        top = float(np.nanpercentile(tput, 99)) * 1.15
        if top > 0:
            ax_tput.set_ylim(0, top)  # one slow step (a restart) must not squash the rest
    ax_tput.set_ylabel("samples/s")
    ax_tput.set_xlabel("seconds since training began" if x == "time" else "step")

    faults = [e for e in run["events"] if e["kind"] in FAULT_KINDS]
    first_agg = next((e for e in faults if e["kind"] == "aggregator_started"), None)
    faults = [e for e in faults if e is not first_agg]  # the first aggregator start is the beginning of training
    kinds_drawn: list[str] = []
    labelled: list[float] = []
    span = (max(xs) - min(xs)) if len(xs) > 1 else 1.0
    for e in faults:
        xe = x_of_time(e["t"])
        if not np.isfinite(xe):
            continue
        color, style = FAULT_KINDS[e["kind"]]
        for ax in axes:
            ax.axvline(xe, color=color, ls=style, lw=1.0, alpha=0.8, gid=f"fault:{e['kind']}")
        if e["kind"] not in kinds_drawn:
            kinds_drawn.append(e["kind"])
        # one label per fault: the kill when a chaos tool recorded it, else the detected death; and restarts
        injected = any(f["kind"] == "fault_injected" and f.get("id") == e.get("id") and 0 <= e["t"] - f["t"] < 30
                       for f in faults)
        wanted = e["kind"] in ("fault_injected", "aggregator_started") or (e["kind"] == "died" and not injected)
        if wanted and all(abs(xe - other) > 0.03 * span for other in labelled):
            labelled.append(xe)
            ax_loss.annotate(_label(e), (xe, 0.03), xycoords=("data", "axes fraction"), rotation=90, va="bottom",
                             ha="right", fontsize=8, color=color,
                             bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7})
    if kinds_drawn:
        series.add("faults")
        fig.legend([Line2D([], [], color=FAULT_KINDS[k][0], ls=FAULT_KINDS[k][1]) for k in kinds_drawn],
                   [k.replace("_", " ") for k in kinds_drawn], loc="outside lower center", ncol=len(kinds_drawn),
                   fontsize=8, frameon=False)

    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best" if ax is ax_eval else "upper right", fontsize=8, framealpha=0.85)
    return fig, series


def plot_run(run_dir: str | Path, out: str | Path | None = None, x: str = "time") -> Path:
    """Write the PNG (default RUN_DIR/plot.png); returns its path."""
    fig, _series = build_figure(run_dir, x=x)
    path = Path(out) if out is not None else Path(run_dir) / "plot.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cmemi plot",
                                description="A PNG of loss, eval, learning rate and throughput, faults marked.")
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", default=None, help="PNG path (default RUN_DIR/plot.png)")
    p.add_argument("--x", choices=("time", "step"), default="time", help="horizontal axis (default: time)")
    args = p.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.output, x=args.x)
    except FileNotFoundError as exc:
        print(f"cmemi: error: {exc}", file=sys.stderr)
        return Exit.FATAL
    print(path)
    return 0
