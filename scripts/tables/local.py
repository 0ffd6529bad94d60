"""Local steps' and streaming's tables: quality at equal samples, bytes per sample, and the emulated cluster's
samples/s (bench/local_steps.py, bench/streaming.py, bench/cluster.py's cmemi_local runs), for
docs/benchmarks/local-steps.md; and the outer codecs' quality (bench/local_steps.py --codecs), for
docs/guides/local-steps.md."""

from __future__ import annotations

from typing import Any

from scripts.tables import provenance
from scripts.tables.provenance import load, measured, sec


def streaming() -> str:
    """bench/streaming.py: Streaming DiLoCo against whole rounds and synchronous steps, eval loss and bytes per sample."""
    d = load("streaming")
    rows = d["rows"]
    sync = next((r for r in rows if r.get("local_steps") == 0 and "error" not in r), None)
    lines = ["| run | server steps | eval loss | vs synchronous | bytes per sample | × fewer than synchronous | "
             "bitwise the reference |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {' '.join(r['error'])[:120]} | | | | | |")
            continue
        vs = f"{r['eval_loss'] / sync['eval_loss'] - 1:+.1%}" if sync else "–"
        fewer = f"{sync['bytes_per_sample'] / r['bytes_per_sample']:.0f}×" if sync else "–"
        lines.append(f"| {r['name']} | {r['server_steps']} | {r['eval_loss']:.3f} | {vs} | "
                     f"{r['bytes_per_sample']:,.0f} | {fewer} | {'yes' if r['params_sha256_equal_reference'] else 'NO'} |")
    return "\n".join([f"charlm, {d['steps']} inner steps' worth of samples (global batch 32), 4 replicas, the default "
                      "outer step; eval loss from `cmemi reference`, bytes from `cmemi up` with 2 workers (every byte "
                      "sent and received; its params_sha256 compared with the reference's).", "", *lines, "",
                      measured("streaming"), "", *streaming_cluster()])


def streaming_cluster() -> list[str]:
    """bench/cluster.py's cmemi_local_stream beside cmemi_local (bench/results/cluster_local.json): the emulated
    cluster's time and bytes per sample, whole rounds against streaming at the same H."""
    c = load("cluster_local")
    rows = [(n, x["runs"]) for n, x in c["by_n"].items()
            if "samples_per_s" in x["runs"].get("cmemi_local_stream", {}) and "samples_per_s" in x["runs"].get("cmemi_local", {})]
    if not rows:
        return []
    lines = ["On the emulated cluster (the sleepy MLP of [the emulated cluster](cluster.md), K = N shards on the worker hosts, "
             "N replicas, the same link rates):", "",
             "| N | H | F | step of the servers | its median time | samples/s | × whole rounds' | bytes/sample | bytes up / "
             "down per step | segments computed ahead |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, runs in rows:
        for name in ("cmemi_local", "cmemi_local_stream"):
            r = runs[name]
            stream = name == "cmemi_local_stream"
            F = r.get("fragments", 1)
            ahead = (f"{r['segments_ahead'] / (r['steps'] * int(n)):.0%} of leases" if stream and r.get("segments_ahead")
                     is not None else "—")
            lines.append(f"| {n} | {r['local_steps']} | {F} | {'segment' if stream else 'round'} of "
                         f"{r['local_steps'] // F} inner steps | {sec(r['step_time_median_s'], 2)} | "
                         f"{r['samples_per_s']:,.0f} | {r['samples_per_s'] / runs['cmemi_local']['samples_per_s']:.2f}× | "
                         f"{r['bytes_per_sample']:,.0f} | {r['bytes_from_workers_per_step'] / 1e6:.1f} MB / "
                         f"{r['bytes_to_workers_per_step'] / 1e6:.1f} MB | {ahead} |")
    return [*lines, "", measured("cluster_local")]


def wall(samples: float | None, per_s: float | None) -> str:
    return f"{samples / per_s:.0f} s" if samples is not None and per_s else "—"


def local_steps() -> str:
    """Local steps (DiLoCo): quality at equal samples (bench/local_steps.py), and per sample on the emulated cluster
    (bench/cluster.py's cmemi_local, with DDP, DDP + PowerSGD and synchronous cmemi_kn in the same run:
    bench/results/cluster_local.json), with the wall-clock to the synchronous run's final loss they imply."""
    d = load("local_steps")
    sync = d["sync"]
    sync_need = sync.get("samples_to_final", d["sync_samples"])  # its first evaluation at or below its final loss
    lines = [f"charlm ({d['steps']} inner steps of {d['config']}'s global batch, {d['replicas']} replicas; eval loss on "
             "its held-out split):", "",
             "| train.local_steps (H) | outer step | eval loss | vs synchronous | samples to the synchronous final loss |",
             "|---|---|---|---|---|",
             f"| 0 (synchronous) | — | {sync['eval_loss']:.3f} | — | {sync_need:,} |"]
    for r in d["runs"]:
        reach = r["samples_to_sync_final"]
        lines.append(f"| {r['local_steps']} | {r['outer']} | {r['eval_loss']:.3f} | {r['eval_vs_sync']:+.1%} | "
                     f"{f'{reach:,}' if reach is not None else 'not reached in ' + format(d['sync_samples'], ',')} |")
    for r in d.get("reach", []):
        reach = r["samples_to_sync_final"]
        lines.append(f"| {r['local_steps']} | {r['outer']}, {r['factor']}× the samples | {r['eval_loss']:.3f} | "
                     f"{r['eval_loss'] / sync['eval_loss'] - 1:+.1%} | "
                     f"{f'{reach:,}' if reach is not None else 'not reached in ' + format(r['curve'][-1]['samples'], ',')} |")
    lines += ["", measured("local_steps")]
    c = load("cluster_local")
    rows = [(n, x["runs"]) for n, x in c["by_n"].items() if "samples_per_s" in x["runs"].get("cmemi_local", {})]
    lines += ["", "| N | H | bytes/sample, synchronous `cmemi_kn` | bytes/sample, `cmemi_local` | × fewer | samples/s: DDP "
              "| DDP + PowerSGD | `cmemi_local` | wall-clock to the synchronous final loss (DDP / DDP + PowerSGD / "
              "`cmemi_local`) |", "|---|---|---|---|---|---|---|---|---|"]
    for n, runs in rows:
        loc, kn = runs["cmemi_local"], runs.get("cmemi_kn", {})
        H = loc["local_steps"]
        tried = [r for r in [*d["runs"], *d.get("reach", [])] if r["local_steps"] == H]
        reached = sorted((r["samples_to_sync_final"], r["outer"]) for r in tried if r["samples_to_sync_final"])
        need, outer = reached[0] if reached else (None, None)

        rates = {k: r.get("samples_per_s") for k, r in runs.items()}

        def rate(k: str, rates: dict[str, Any] = rates) -> float | None:
            return rates.get(k)

        local_wall = (f"{wall(need, rate('cmemi_local'))} ({outer})" if need is not None else
                      "not reached" if tried else "H not in the quality table")
        fewer = (f"{kn['bytes_per_sample'] / loc['bytes_per_sample']:.0f}" if kn.get("bytes_per_sample") else "—")

        def num(x: float | None) -> str:
            return "—" if x is None else f"{x:,.0f}"

        lines.append(f"| {n} | {H} | {num(kn.get('bytes_per_sample'))} | {num(loc['bytes_per_sample'])} | {fewer} | "
                     f"{num(rate('ddp'))} | {num(rate('ddp_powersgd'))} | {num(rate('cmemi_local'))} | "
                     f"{wall(sync_need, rate('ddp'))} / {wall(sync_need, rate('ddp_powersgd'))} / "
                     f"{local_wall} |")
    if "best_loss" in sync:
        lines += ["", f"The synchronous run's best eval loss was {sync['best_loss']:.3f}; it first reached its final "
                  f"loss at {sync_need:,} samples of {d['sync_samples']:,} (a small model on a small corpus overfits late "
                  "in a long run), and that is the sample count its wall-clock below is taken at."]
    lines += ["", "Wall-clock = the samples each needs on charlm (DDP and DDP + PowerSGD taken as synchronous training: "
              "PowerSGD's own loss is not measured, which favours it) ÷ its samples/s on the emulated cluster (the "
              "sleepy MLP of the other rows, `--local-steps` H); for local steps, the fewest samples at which a run with "
              "that H reached the synchronous run's final loss, and its outer step (the outer step costs no time).",
              "", measured("cluster_local")]
    return "\n".join(lines)


OUTER_CODECS = "outer_codecs"
OUTER_CODECS_RUN = ".venv/bin/python bench/local_steps.py --codecs --jobs 2 --out bench/results/outer_codecs.json"


def codec_name(r: dict[str, Any]) -> str:
    """A row's outer change: the codec, with sparse2's top-k fraction (a row's `codec_sets` may raise it from the
    default 1 %; older results files have none)."""
    sets = r.get("codec_sets", [])
    ratio = next((float(x.split("=", 1)[1]) for x in sets if x.startswith("compression.topk_ratio=")), 0.01)
    rest = [f"`{x}`" for x in sets if not x.startswith("compression.topk_ratio=")]
    name = {"none": "fp32", "int4": "int4 (chunks of 128)",
            "sparse2": f"sparse2 ({ratio:.0%}, 2-bit, per-replica error feedback)"}.get(r["codec"], r["codec"])
    return ", ".join([name, *rest])


def outer_codecs() -> str:
    """bench/local_steps.py --codecs (issue 48): eval loss at equal samples on the stdlib corpus, synchronous against
    whole rounds and streaming at each H with fp32, int4 and sparse2 outer changes. Not measured yet: a line that says
    how; a results file without the rows: an error naming the command, as every table here."""
    if not (provenance.RESULTS / f"{OUTER_CODECS}.json").exists():  # read at call time: tests point it elsewhere
        return ("Not measured yet: `.venv/bin/python bench/local_steps.py --codecs --jobs 2` measures it (with `--out` "
                "naming `outer_codecs.json` in `bench/results/`), then `.venv/bin/python scripts/readme_tables.py` "
                "writes this table.")
    d = load(OUTER_CODECS)
    if not d.get("codecs"):
        raise KeyError(f"bench/results/{OUTER_CODECS}.json has no 'codecs' rows (an old or failed run): run "
                       f"`{OUTER_CODECS_RUN}` again")
    lines = [f"charlm on the Python standard library's sources ({d['corpus']}; {d['steps']} inner steps of a global "
             f"batch of {d['global_batch']}, {d['replicas']} replicas, the {d['outer']} outer step; eval loss on the "
             "held-out files at equal samples; + is worse):", "",
             "| system | H | outer change | eval loss | vs synchronous | vs fp32 changes |", "|---|---|---|---|---|---|"]
    for r in d["codecs"]:
        local = r["system"] != "sync"
        system = {"sync": "synchronous", "whole": "whole rounds"}.get(r["system"], f"streaming, F = {r['fragments']}")
        vs_sync = f"{r['vs_sync']:+.1%}" if local else "—"
        vs_fp32 = f"{r['vs_fp32']:+.1%}" if local and r["codec"] != "none" else "—"
        lines.append(f"| {system} | {r['local_steps'] if local else '—'} | {codec_name(r) if local else '—'} | "
                     f"{r['eval_loss']:.3f} | {vs_sync} | {vs_fp32} |")
    if d.get("note"):
        lines += ["", f"Run length: {d['note']}"]
    sync = next(r for r in d["codecs"] if r["system"] == "sync")
    tail = list({p["samples"]: p["loss"] for p in sync["curve"]}.values())[-4:]  # the final eval may repeat the last
    falling = all(b < a for a, b in zip(tail, tail[1:], strict=False))
    lines += ["", f"The synchronous run's last evaluations: {', '.join(f'{x:.3f}' for x in tail)} "
              f"({'still falling: the corpus is not overfit within the run' if falling else 'NOT still falling'})."]
    rows = [r for r in d["codecs"] if r["system"] != "sync"]
    low = [r for r in rows if r["codec"] != "none"]
    near = [r for r in low if r["vs_fp32"] <= 0.01]
    lines += ["", f"Issue 48's goals: within 3 % of synchronous training, {sum(r['vs_sync'] <= 0.03 for r in rows)} "
              f"of {len(rows)} local rows; low-bit changes within 1 % of fp32 changes, {len(near)} of {len(low)} "
              f"({', '.join(sorted({codec_name(r) for r in near})) or 'none'})."]
    if d.get("missing"):
        lines += ["", f"Not measured (the run was cut short before them): {', '.join(d['missing'])}."]
    return "\n".join([*lines, "", measured(OUTER_CODECS)])
