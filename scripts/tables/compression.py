"""The compression table: bytes, codec time and accuracy against dense both ways of every codec and downlink
(bench/compression.py, bench/hook_accuracy.py), for docs/benchmarks/compression.md."""

from __future__ import annotations

from typing import Any

from scripts.tables import provenance
from scripts.tables.provenance import load, measured


def compression() -> str:
    d = load("compression")
    lines = ["| example | codec | downlink | microbatches per lease | gradients / step | bytes/step | × fewer than "
             "`none` | bytes/step down | eval | vs dense both ways | codec ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for example, rows in d["examples"].items():
        base = next((x for x in rows if x["codec"] == x.get("downlink", "none") == "none"), None)
        for x in rows:
            ev = (f"accuracy {x['eval_accuracy']:.4f}" if "eval_accuracy" in x
                  else f"loss {x['eval_loss']:.3f}" if "eval_loss" in x else "-")
            reps = x.get("eval_by_seed") or x.get("eval_repeats", [])
            if len(set(reps)) > 1:
                ev += f" ({min(reps):.3f}–{max(reps):.3f})"
            gap, seeds = x.get("eval_vs_dense"), x.get("eval_vs_dense_by_seed", [])
            if gap is None or base is None:
                vs = "–"
            elif "eval_accuracy" in x:
                vs = f"{gap * 100:+.2f} points" + (
                    f" ({min(seeds) * 100:+.2f} to {max(seeds) * 100:+.2f})" if len(set(seeds)) > 1 else "")
            else:
                rel = [g / b for g, b in zip(seeds, base.get("eval_by_seed", []), strict=False)]
                vs = f"{x.get('eval_vs_dense_rel', gap / base['eval_loss']):+.1%}" + (
                    f" ({min(rel):+.1%} to {max(rel):+.1%})" if len(set(rel)) > 1 else "")
            lease = [str(x[k]) if k in x else "–" for k in ("lease_microbatches", "gradients_per_step")]
            lines.append(f"| {example} | {codec_label(x)} | `{x.get('downlink', 'none')}` | {' | '.join(lease)} | "
                         f"{x['bytes_sent_per_step']:,.0f} | {x['ratio_vs_none']:.1f} | "
                         f"{x['bytes_received_per_step']:,.0f} | {ev} | {vs} | "
                         f"{x['codec_s_per_step_median'] * 1000:.2f} |")
    hook = hook_accuracy()
    return "\n".join([*lines, "", *compression_goal(d), *hook,
                      measured("compression", *(["hook_accuracy"] if hook else []))])


def hook_accuracy() -> list[str]:
    """DDP's PowerSGD hook against dense DDP on the same examples (bench/hook_accuracy.py; optional file): the speed
    goal's baseline, measured as the rows above are."""
    if not (provenance.RESULTS / "hook_accuracy.json").is_file():
        return []
    d = load("hook_accuracy")
    parts = []
    for example, x in d["examples"].items():
        gaps = x["hook_vs_dense_by_seed"]
        if x["metric"] == "accuracy":
            parts.append(f"{example} {x['hook_vs_dense'] * 100:+.2f} points ({min(gaps) * 100:+.2f} to "
                         f"{max(gaps) * 100:+.2f})")
        else:
            rel = [g / b for g, b in zip(gaps, x["ddp_dense_by_seed"], strict=True)]
            parts.append(f"{example} {x['hook_vs_dense_rel']:+.1%} ({min(rel):+.1%} to {max(rel):+.1%})")
    seeds = len(next(iter(d["examples"].values()))["hook_vs_dense_by_seed"])
    return [f"DDP's own PowerSGD hook (rank {d['hook_rank']}, the cluster table's baseline), against dense DDP on the "
            f"same examples, seeds 0–{seeds - 1}, steps and data (`bench/hook_accuracy.py`): " + "; ".join(parts) + ".",
            ""]


def codec_label(row: dict[str, Any]) -> str:
    """A compression row's codec, with powersgd's rank where the row ran powersgd (either way)."""
    rank = row.get("powersgd_rank")
    return f"`{row['codec']}`" + (f" (rank {rank})" if rank is not None and row["codec"] == "powersgd" else "")


ACCURACY_GOAL = {"eval_accuracy": 0.01, "eval_loss": 0.02}  # issue 32: within 1 point / 2 % of dense both ways


def compression_goal(d: dict[str, Any]) -> list[str]:
    """Which rows compressed both ways (or down only) keep issue 32's accuracy goal, from the rows' mean gaps."""
    out = []
    for example, rows in d["examples"].items():
        parts = []
        base = next((x for x in rows if x["codec"] == x.get("downlink", "none") == "none"), None)
        for x in rows:
            if x.get("downlink", "none") == "none" or x.get("eval_vs_dense") is None or base is None:
                continue
            metric = "eval_accuracy" if "eval_accuracy" in x else "eval_loss"
            gap = (-x["eval_vs_dense"] if metric == "eval_accuracy"
                   else x.get("eval_vs_dense_rel", x["eval_vs_dense"] / base["eval_loss"]))
            ok = "✓" if gap <= ACCURACY_GOAL[metric] else "✗"
            shown = f"{-gap * 100:+.2f} points" if metric == "eval_accuracy" else f"{gap:+.1%}"
            parts.append(f"{codec_label(x)}/`{x['downlink']}` {shown} {ok}")
        if parts:
            seeds = len(next((x["eval_by_seed"] for x in rows if "eval_by_seed" in x), [None]))
            goal = "1 point of accuracy" if "eval_accuracy" in rows[0] else "2 % of the eval loss"
            out.append(f"{example} (goal: within {goal} of dense both ways"
                       + (f", the mean over {seeds} seeds" if seeds > 1 else "") + "): " + "; ".join(parts) + ".")
    return [*out, ""] if out else []
