"""The README's figure tables, generated from bench/results/*.json (what `make bench` writes).

`python scripts/readme_tables.py` rewrites every block between `<!-- NAME:start ... -->` and `<!-- NAME:end -->`
in README.md; `--check` exits 1 when one differs (tests/test_readme.py runs the same comparison). A figure
that is in no results file has no place in these tables.

Every results file says which commit and date it was measured at (`commit`, `dirty`, `date`: bench/common.py's
`provenance`), and each generated block ends with that line; a results file without them stops the generator
(ProvenanceError), so no figure reaches the README without the code it describes.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RESNET = ROOT / "docs" / "resnet_accuracy.json"
README = ROOT / "README.md"
GENERATOR = ".venv/bin/python scripts/readme_tables.py"


class ProvenanceError(ValueError):
    """A results file that does not say which commit and date its figures were measured at."""


def shown(path: Path) -> str:
    """How the README names a results file (`bench/results/NAME.json` wherever RESULTS points)."""
    return f"bench/results/{path.name}" if path.parent == RESULTS else str(path.relative_to(ROOT))


def check_provenance(path: Path, d: dict[str, Any]) -> None:
    where = shown(path)
    commit, date, dirty = d.get("commit"), d.get("date"), d.get("dirty")
    if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit)) or not isinstance(date, str) \
            or not re.match(r"\d{4}-\d\d-\d\d", date):
        raise ProvenanceError(
            f"{where} does not say which commit and date it was measured at (`commit`: the full sha, `date`: UTC "
            f"ISO 8601, `dirty`: true/false; got commit={commit!r}, date={date!r}): re-measure it with its script, "
            "which writes them (bench/common.py: provenance), or recover them from `git log -- FILE` with a "
            "`commit_note` saying so")
    if not isinstance(dirty, bool) and not d.get("commit_note"):
        raise ProvenanceError(f"{where}: `dirty` is {dirty!r}; give true/false, or a `commit_note` saying why it is "
                              "not known")


def load_path(path: Path) -> dict[str, Any]:
    d = json.loads(path.read_text())
    check_provenance(path, d)
    return d


def load(name: str) -> dict[str, Any]:
    return load_path(RESULTS / f"{name}.json")


def check_all() -> None:
    """Every results file, quoted in the README or not, carries its commit and date."""
    for path in [*sorted(RESULTS.glob("*.json")), RESNET]:
        load_path(path)


def measured(*names: str, paths: tuple[Path, ...] = ()) -> str:
    """'Measured at commit X on DATE' for the results files a block quotes; files measured at the same commit
    share one clause."""
    files = [*(RESULTS / f"{n}.json" for n in names), *paths]
    groups: dict[tuple[str, Any, str], list[str]] = {}
    for path in files:
        d = load_path(path)
        groups.setdefault((d["commit"], d["dirty"], d["date"][:10]), []).append(f"`{shown(path)}`")
    clauses = []
    for (commit, dirty, day), where in groups.items():
        if dirty is None:  # recovered from git log afterwards
            clauses.append(f"at or before commit `{commit[:7]}`, on or before {day} ({', '.join(where)}: recovered "
                           "from `git log`, not recorded when measured)")
        else:
            clauses.append(f"at commit `{commit[:7]}`{' with uncommitted changes' if dirty else ''} on {day} "
                           f"({', '.join(where)})")
    caveats: dict[str, list[str]] = {}
    for path in files:
        if caveat := load_path(path).get("caveat"):
            caveats.setdefault(caveat, []).append(f"`{shown(path)}`")
    return " ".join(["Measured " + "; ".join(clauses) + ".",
                     *(f"{', '.join(where)} {'was' if len(where) == 1 else 'were'} {caveat}."
                       for caveat, where in caveats.items())])


def measured_at(d: dict[str, Any], where: str) -> str:
    """'Measured at commit X on DATE' for a section of a results file that records its own provenance."""
    return (f"Measured at commit `{d['commit'][:7]}`{' with uncommitted changes' if d['dirty'] else ''} on "
            f"{d['date'][:10]} (`{where}`).")


def ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


def sec(s: float | None, digits: int = 3) -> str:
    return "none recovered" if s is None else f"{s:.{digits}f} s"  # None: a baseline that never came back


def span(values: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def machine_line() -> str:
    machines = [load(n)["machine"] for n in ("overhead", "transport", "recovery", "torchft_recovery", "checkpoint",
                                              "scaling")]
    loads = [m[k][0] for m in machines for k in ("loadavg_at_start", "loadavg_at_end")]
    m = machines[0]
    return (f"Measured on {m['cpus']} CPU cores, torch {m['torch']}, Python {m['python']}, one torch thread per "
            f"process, 1-minute load average {span(loads, '{:.1f}')} during the runs (other jobs shared the machine); "
            "every comparison was measured side by side in the same run.")


def benchmark() -> str:
    o, t, r = load("overhead"), load("transport"), load("recovery")
    ft, c, s = load("torchft_recovery"), load("checkpoint"), load("scaling")
    cb, mb = o["ratios"]["compute_bound"], o["ratios"]["comm_bound"]
    cst, mst = o["step_times"]["compute_bound"]["median_step_time_s"], o["step_times"]["comm_bound"]["median_step_time_s"]
    mw = o["step_times"]["comm_bound"]["workload"]
    ok = {True: " ✓", False: " ✗"}
    tgt = o["targets"]
    sb = o["step_times"]["comm_bound"].get("socket_bytes_per_grad_byte", {})
    cf = o.get("copy_floor", {}).get("comm_bound")
    ratio = t["ratio_protocol_vs_raw"]
    vs_sum = [v["protocol_vs_raw_sum"] for v in t["ratios"].values()]
    sizes = list(ratio)
    wk = r["cmemi_worker_kills"]
    ak = r["cmemi_aggregator_kills"]
    tr = r["torchrun"]
    ft5, ft1 = ft["summary"]["torchft[heartbeat_timeout_ms=5000]"], ft["summary"]["torchft[heartbeat_timeout_ms=1000]"]
    runs = {x["param_MB"]: x for x in c["real_runs"]}
    store = c["store"]
    big = s["by_params"][-1]
    small = s["by_params"][0]
    rows = [
        ("step time, compute-bound CNN: CMEMI 1 worker / plain PyTorch loop",
         f"**{cb['cmemi_1w_vs_plain']:.2f}×** ({sec(cst['cmemi_1w'])} vs {sec(cst['plain'])}; CPU seconds per step "
         f"{cb['cpu_cost']['cmemi_1w_vs_plain']:.2f}×)",
         "≤ 1.10" + ok[tgt["compute_bound_cmemi_1w_vs_plain_le_1.10"]]),
        ("step time, compute-bound: CMEMI 2 workers / torchrun DDP (gloo) 2 processes",
         f"**{cb['cmemi_2w_vs_ddp_2p']:.2f}×** ({sec(cst['cmemi_2w'])} vs {sec(cst['ddp_2p'])})",
         "≤ 1.00" + ok[tgt["compute_bound_cmemi_2w_vs_ddp_2p_le_1.00"]]),
        (f"step time, comm-bound ({o['model_params']['comm_bound'] / 1e6:.1f} M params, batch {mw['global_batch']}): "
         "CMEMI 1 worker / plain",
         f"{mb['cmemi_1w_vs_plain']:.2f}× ({sec(mst['cmemi_1w'])} vs {sec(mst['plain'])}: every step ships the "
         f"gradients ({o['model_params']['comm_bound'] * 4 / 1e6:.0f} MB) and the parameters through the aggregator, "
         "which a single process never does)", "≤ 2.00" + ok[mb["cmemi_1w_vs_plain"] <= 2.00]),
        ("step time, comm-bound: CMEMI 2 workers / DDP 2 processes (CMEMI with CurveZMQ on, the default)",
         f"{mb['cmemi_2w_vs_ddp_2p']:.2f}× ({sec(mst['cmemi_2w'])} vs {sec(mst['ddp_2p'])})",
         "≤ 1.00" + ok[mb["cmemi_2w_vs_ddp_2p"] <= 1.00]),
        *([("step time, comm-bound: CMEMI 2 workers and 2 shards (`cluster.shards: 2`) / DDP 2 processes",
            f"{mb['cmemi_2w_k2_vs_ddp_2p']:.2f}× ({sec(mst['cmemi_2w_k2'])} vs {sec(mst['ddp_2p'])}; one more busy "
            "process on the 2 shared cores, and on loopback there is no link to split: shards pay off across hosts, "
            "see [Scaling out](#scaling-out))",
            "≤ 1.00" + ok[tgt["comm_bound_cmemi_2w_k2_vs_ddp_2p_le_1.00"]])] if "cmemi_2w_k2_vs_ddp_2p" in mb else []),
        *([("step time, comm-bound: CMEMI 2 workers with `security.curve: false` / DDP 2 processes (gloo encrypts "
            "nothing)", f"{mb['cmemi_2w_nocurve_vs_ddp_2p']:.2f}× ({sec(mst['cmemi_2w_nocurve'])} vs "
            f"{sec(mst['ddp_2p'])}: what is left without encryption)", "—")]
          if "cmemi_2w_nocurve_vs_ddp_2p" in mb else []),
        *([("step time, comm-bound: CMEMI 1 worker / plain, per transport: shared-memory slots (the default on one "
            "host) / tcp:// without Curve / CurveZMQ tcp://",
            f"{mb['cmemi_1w_vs_plain']:.2f}× / {mb['cmemi_1w_nocurve_vs_plain']:.2f}× / "
            f"{mb['cmemi_1w_tcp_vs_plain']:.2f}×; bytes through the aggregator's socket per gradient byte "
            f"{sb['cmemi_1w']} / {sb['cmemi_1w_nocurve']} / {sb['cmemi_1w_tcp']}", "")]
          if "cmemi_1w_tcp_vs_plain" in mb else []),
        *([("comm-bound, CMEMI 1 worker over slots: time over the plain loop per step, against the copies it cannot "
            "avoid",
            f"{cf['cmemi_1w_over_plain_ms']} ms; two copies of the parameters' bytes ({cf['bytes_per_copy'] / 1e6:.0f} "
            f"MB each: a gradient into the worker's slot, a version into the leader's; each side reads the other's in "
            f"place) take {cf['warm_ms_per_step']}–{cf['cold_ms_per_step']} ms here ({cf['warm_GB_per_s']} / "
            f"{cf['cold_GB_per_s']} GB/s warm / cold, same run); in py-spy profiles the rest is a NaN/inf pass over the gradient on each "
            "side, cold reads of what the other process wrote, and the messages", "")] if cf else []),
        ("aggregator ingest (receive + header + xxh3 checksum + decode + ordered sum + NaN/inf check) / raw ZeroMQ "
         "PUSH/PULL of the same buffers",
         f"{span(list(ratio.values()), '{:.2f}')} ({sizes[0]}–{sizes[-1]} messages); against a raw receiver that "
         f"**also sums**: {span(vs_sum, '{:.2f}')}",
         "≥ 0.8" + ok[t["target_protocol_vs_raw_ge_0.8"]]),
        *([("CurveZMQ on / off (the default is on), comm-bound step: CMEMI 2 workers, the two rows above",
            f"**{mst['cmemi_2w'] / mst['cmemi_2w_nocurve']:.2f}×** ({sec(mst['cmemi_2w'])} vs "
            f"{sec(mst['cmemi_2w_nocurve'])}, side by side in the same run). Encryption and authentication are one "
            "more pass over every byte in each sender and receiver: for a comm-bound model on a network you trust, "
            "`security.curve: false` is the fast path", "")] if "cmemi_2w_nocurve" in mst else []),
        ("worker SIGKILL → its replacement's first gradient accepted (median, warm spare)",
         f"**{sec(wk['timeline_median_s']['first_grad_s'])}** over {wk['kills']} kills, "
         f"{wk['steps']['steps_lost']} steps lost, {wk['steps']['steps_redone']} redone", "< 3 s" +
         ok[wk["timeline_median_s"]["first_grad_s"] < 3]),
        (f"aggregator SIGKILL → training again (checkpoint every {ak['checkpoint_every_steps']} steps)",
         f"{sec(ak['recovery_s_median'], 1)} (median of {ak['kills']}), {ak['steps_redone_median']:.0f} steps redone "
         "(bitwise the same numbers)", ""),
        ("torchrun `--max-restarts=3` elastic, worker SIGKILL → training again",
         "; ".join(f"{sec(v['recovery_s_median'], 1)}, {v['recovered']}/{v['kills_attempted']} recovered"
                   + (" with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`" if v["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] else "")
                   for v in tr.values())
         + "; the whole group restarts from its checkpoint"
         + next((f", {v['steps_redone_median']:.0f} steps redone" for v in tr.values()
                 if v.get("steps_redone_median") is not None), ""),  # a variant that never recovered redid nothing
         ""),
        (f"torchft {ft['torchft']} (lighthouse + 2 replica groups), replica SIGKILLed and restarted",
         f"default 5 s heartbeat timeout: the survivor stalls **{sec(ft5['survivor_max_gap_s_median'], 1)}** "
         f"({ft5['recovered']} recovered, {ft5['killed_replica_steps_redone_median']} steps redone, "
         f"{ft5['steps_with_samples_missing_median']} step with samples missing); 1 s timeout: the survivor stalls "
         f"{sec(ft1['survivor_max_gap_s_median'], 1)} and trains alone for {ft1['survivor_steps_alone_median']} steps on "
         f"**part of each global batch** until the replacement has healed ({sec(ft1['rejoin_s_median'], 1)})", ""),
        ("training stall per checkpoint (snapshot on the aggregator; measured before the copy-on-write sends of issue 34)",
         "; ".join(f"{ms(x['snapshot_stall_s_median'])} at {mb_:.0f} MB of parameters (a step: "
                   f"{ms(x['step_time_other_median_s'])}; the step after a snapshot: "
                   f"{ms(x['step_time_after_snapshot_median_s'])})" for mb_, x in sorted(runs.items())),
         "small fraction of a step"),
        ("checkpoint write (safetensors + xxh3-128 manifest + fsync + rename)",
         ", ".join(f"{x['write_MB_s']:.0f} MB/s at {x['MiB']:.0f} MiB" for x in store)
         + f" ({span([x['store_vs_raw'] for x in store], '{:.2f}')} of a plain write + fsync of the same bytes)", ""),
        ("aggregator memory vs parameters",
         f"{small['aggregator_hwm_MB']:.0f} MB peak RSS at {small['param_MB']:.0f} MB of parameters, "
         f"{big['aggregator_hwm_MB']:.0f} MB at {big['param_MB']:.0f} MB "
         f"(≈ {big['aggregator_rss_per_param_byte']:.1f} bytes per parameter byte)", ""),
        (f"{big['param_MB']:.0f} MB of parameters, 1 worker: step time, minor page faults per step (huge pages on)",
         f"{sec(big['step_time_median_s'], 2)}, {big['minor_page_faults_per_step'].get('aggregator', '-')} "
         f"(aggregator), {big['minor_page_faults_per_step'].get('worker', '-')} (worker)", ""),
    ]
    lines = [machine_line(), "", "| what | figure | target |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c_} |" for a, b, c_ in rows]
    lines += ["", measured("overhead", "transport", "recovery", "torchft_recovery", "checkpoint", "scaling")]
    return "\n".join(lines)


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
    if not (RESULTS / "hook_accuracy.json").is_file():
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
    lines = ["On the emulated cluster (the sleepy MLP of [Scaling out](#scaling-out), K = N shards on the worker hosts, "
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


def scaling() -> str:
    s = load("scaling")
    lines = ["| workload | workers | step time (median) | speedup vs 1 worker | bytes to the aggregator / step | "
             "aggregator peak RSS |", "|---|---|---|---|---|---|"]
    for kind, rows in s["by_workers"].items():
        for x in rows:
            lines.append(f"| {kind.replace('_', '-')}, batch {x['global_batch']}, {x['microbatches']} microbatches | "
                         f"{x['workers']} | {sec(x['step_time_median_s'])} | {x['speedup_vs_1w']:.2f}× | "
                         f"{x['bytes_in_per_step'] / 1e6:.2f} MB | {x['aggregator_hwm_MB']:.0f} MB |")
    for x in s["by_params"]:
        lines.append(f"| {x['param_MB']:.0f} MB of parameters | 1 | {sec(x['step_time_median_s'])} | — | "
                     f"{x['bytes_in_per_step'] / 1e6:.2f} MB | {x['aggregator_hwm_MB']:.0f} MB |")
    return "\n".join([*lines, "", measured("scaling")])


def small() -> str:
    """bench/small.py: small models' step time against a plain loop, and `cmemi up`'s start-up (optional file)."""
    if not (RESULTS / "small.json").is_file():
        return "No results yet: `make bench BENCHES=small BENCH_ARGS=` writes `bench/results/small.json`."
    d = load("small")
    m = d["machine"]
    lines = [f"Measured with `{d['command']}` on {m['cpus']} CPU cores, torch {m['torch']}, 1-minute load average "
             f"{span([m['loadavg_at_start'][0], m['loadavg_at_end'][0]], '{:.1f}')}; {d['dataset']}, {d['optimizer']}, "
             f"batch {d['global_batch']} in {d['microbatches']} microbatches, {d['steps']} steps "
             f"(median of {d['repeats']}); ms per step = training wall-clock time per step after "
             f"{d['warmup_skipped']} warm-up steps.", "",
             "| workload | plain PyTorch loop (all cores) | CMEMI 1 worker | CMEMI 1 worker, 1 loader | CMEMI 2 workers "
             "| CMEMI 2 workers, 1 loader each |", "|---|---|---|---|---|---|"]
    for wl, x in d["ms_per_step"].items():
        r = d["ratios"][wl]
        cells = [f"{x[v]:.2f} ms ({r[f'{v}_vs_plain']:.2f}×)" if v in x else "–"
                 for v in ("cmemi_1w", "cmemi_1w_loader", "cmemi_2w", "cmemi_2w_loader")]
        lines.append(f"| {wl} | {x['plain']:.2f} ms | " + " | ".join(cells) + " |")
    w = d.get("wire_us_per_message")
    if w:
        lines += ["", "One parameter message (encode, send, receive, decode on loopback), tensor by tensor against "
                  "flat buffers (`shared/wire/layout.py`): " + "; ".join(
                      f"{name} ({x['tensors']} tensors, {x['bytes'] / 1e3:.0f} kB) {x['per_tensor_us']:.0f} → "
                      f"{x['flat_us']:.0f} µs" for name, x in w.items()) + "."]
    st = d["startup"]
    lines += ["", f"`cmemi up digits` → its first step: **{st['first_step_s']:.1f} s** (target ≤ 5 s on an idle machine; "
              f"load average {' '.join(str(x) for x in st['load_avg'])} when it was measured). When each process "
              "reached each phase (seconds since `cmemi up` started; CPU seconds it had used by then):", "",
              "| process | phases | CPU s |", "|---|---|---|"]
    for name, phases in [*st["processes"].items(), ("run", st["run"])]:
        cpu = st["cpu_s"].get(name)
        lines.append(f"| {name} | {', '.join(f'{k} {v:.2f}' for k, v in phases.items())} | "
                     f"{'' if cpu is None else f'{cpu:.2f}'} |")
    lines += ["", measured("small")]
    if (slow := d.get("slow_import")) and "median_first_step_s" in slow:
        t, ok = slow["targets"], {True: "met", False: "missed"}
        lines += ["", f"A user module slow to import and to build its data (`bench/slow_import_model.py`, measured with "
                  f"`{slow['command']}`, median of {len(slow['runs'])}): T = {slow['median_plain_import_and_dataset_s']:.2f} s "
                  f"in a plain Python process; `cmemi up` with 2 workers reached its first step at "
                  f"**{slow['median_first_step_s']:.2f} s** (T + {slow['median_first_step_minus_plain_s']:.2f} s; goal T + 3 s: "
                  f"{ok[t['first_step_within_T_plus_3s']]}) and returned **{slow['median_returned_after_last_step_s']:.2f} s** "
                  f"after its last step (goal ≤ 2 s: {ok[t['returns_within_2s_of_last_step']]}). "
                  + measured_at(slow, "bench/results/small.json (slow_import)")]
    return "\n".join(lines)


def memory() -> str:
    """bench/memory.py: peak RSS per process of a big model's cluster against issue 34's budgets (optional file)."""
    if not (RESULTS / "memory.json").is_file():
        return ("No results yet: `.venv/bin/python bench/memory.py --out bench/results/memory.json` writes them "
                "(about 15 min on 2 cores).")
    d = load("memory")
    lines = [memory_lines(d)]
    scaled = d.get("scaled")
    if scaled and "skipped" in scaled:
        lines += ["", f"The {scaled['scale']:g}× larger model was not run: {scaled['skipped']}."]
    elif scaled:
        lines += ["", f"The {scaled['scale']:g}× larger model:", "", memory_lines({**d, **scaled})]
    return "\n".join([*lines, "", measured("memory")])


def memory_lines(d: dict[str, Any]) -> str:
    m, w, ddp = d["model"], d["workload"], d["ddp"]
    ok = {True: "✓", False: "✗"}

    def mb(x: float) -> str:
        return f"{x:,.0f} MB"

    kw = m["kwargs"]
    lines = [f"Measured with `{d['command']}`: an MLP {kw['in_dim']}-{kw['hidden']}×{kw['depth'] - 1}-10 "
             f"({m['params'] / 1e6:.1f} M parameters, {m['param_MB']:,.0f} MB of fp32), {m['optimizer']}, "
             f"{w['workers']} workers, batch {w['global_batch']} in {w['microbatches']} microbatches, {w['steps']} "
             f"steps with a checkpoint every {w['checkpoint_every']}. Peak RSS = VmHWM of each process, sampled "
             f"until it exits; interpreter (Python, torch and the services imported) {mb(d['interpreter_MB'])}. "
             f"Two DDP ranks (torchrun, gloo, {m['optimizer']}, the same batch and checkpoints) peaked at "
             f"{' + '.join(mb(x) for x in ddp['ranks_peak_MB'])} = {mb(ddp['ranks_total_MB'])}. Budgets (issue 34): "
             "a shard 1.5 × (its slice + its optimizer state + one gradient sum), a worker 1.3 × (parameters + "
             "gradients), each plus the interpreter; the checkpointer the interpreter + 2 × the transfer cap; the "
             "whole cluster (every process's peak summed, `cmemi up`, Redis and the zygote included) 1.5 × the DDP "
             "ranks.", "",
             "| K | process | peak RSS | × parameter bytes | budget | met |", "|---|---|---|---|---|---|"]
    for k, r in d["by_shards"].items():
        procs = r["processes"]
        budgeted = [p for p in procs if "budget_MB" in p]
        shards = sorted((p for p in budgeted if p["role"].startswith("shard")),
                        key=lambda p: (int(p["role"].split()[1]), -p["peak_MB"]))
        rows, seen = [], set()
        for p in shards:  # a restarted shard: its largest incarnation
            if p["role"] not in seen:
                seen.add(p["role"])
                rows.append((p["role"] + (" (leader)" if p["role"] == "shard 0" else ""), p))
        workers = [p for p in budgeted if p["role"].startswith("worker")]
        if workers:
            rows.append(("each worker (largest)", max(workers, key=lambda p: p["peak_MB"])))
        for role in sorted({p["role"] for p in budgeted if not p["role"].startswith(("shard", "worker"))}):
            rows.append((role, max((p for p in budgeted if p["role"] == role), key=lambda p: p["peak_MB"])))
        for name, p in rows:
            lines.append(f"| {k} | {name} | {mb(p['peak_MB'])} | {p['x_param_bytes']:.1f} | {mb(p['budget_MB'])} | "
                         f"{ok[p['within_budget']]} |")
        lines.append(f"| {k} | **whole cluster** | **{mb(r['cluster_total_MB'])}** | {r['cluster_x_param_bytes']:.1f} | "
                     f"{mb(r['cluster_budget_MB'])} (1.5 × DDP's {mb(ddp['ranks_total_MB'])}) | "
                     f"{ok[r['cluster_within_budget']]} |")
    times = "; ".join(f"K = {k} {r['step_time_median_s']:.2f} s ({r['step_time_vs_ddp']:.2f}× DDP)"
                      for k, r in d["by_shards"].items())
    sha = ("the same at every K" if d["params_sha256_same"] else
           "**differ between K** (" + ", ".join(f"K = {k} `{r['params_sha256'][:12]}`" for k, r in d["by_shards"].items())
           + ")")
    lines += ["", f"Step time (median, 2 shared cores: for the record, the goal is memory): {times}; DDP "
              f"{ddp['step_time_median_s']:.2f} s. `params_sha256`: {sha}."]
    died = {k: [f for f in r.get("faults", []) if f["kind"] == "died"] for k, r in d["by_shards"].items()}
    if any(died.values()):
        lines[-1] += (" Processes that died and were replaced mid-run (their replacements' peaks, restore included, "
                      "are in the table): " + "; ".join(
                          f"K = {k}: " + ", ".join(f"{f['role'] if f['role'] != 'aggregator' else 'shard'} {f['id']} "
                                                   f"after step {f['after_step']} ({f['how']})" for f in fs)
                          for k, fs in died.items() if fs) + ".")
    return "\n".join(lines)


CLUSTER_ROWS = {"ddp": "torchrun-style DDP (gloo), dense", "ddp_powersgd": "DDP + PowerSGD hook (rank 2)",
                "cmemi_k1": "CMEMI, 1 aggregator (K = 1), dense",
                "cmemi_kn": "CMEMI, K = N shards on the worker hosts, dense",
                "cmemi_kn_dedicated": "CMEMI, K = N shards on dedicated hosts, dense",
                "cmemi_kn_pipelined": "CMEMI, N shards on dedicated hosts + leader, pipelined stages, dense",
                "cmemi_kn_nocurve": "CMEMI, K = N shards on the worker hosts, dense, CurveZMQ off",
                "cmemi_kn_powersgd": "CMEMI, K = N shards on the worker hosts, `powersgd` (rank 2)",
                "cmemi_k1_powersgd": "CMEMI K = 1, `powersgd` (rank 2)",
                "cmemi_k1_topk": "CMEMI K = 1, `topk` (1 %)",
                "cmemi_kn_powersgd2": "CMEMI, K = N shards on the worker hosts, `powersgd` both ways (rank 2)",
                "cmemi_kn_dedicated_powersgd2": "CMEMI, K = N shards on dedicated hosts, `powersgd` both ways (rank 2)",
                "cmemi_k1_powersgd2": "CMEMI K = 1, `powersgd` both ways (rank 2)",
                "cmemi_kn_topk2": "CMEMI, K = N shards on the worker hosts, `topk` both ways (1 %)",
                "cmemi_k1_topk2": "CMEMI K = 1, `topk` both ways (1 %)",
                "cmemi_kn_powersgd_sign": "CMEMI, K = N shards on the worker hosts, `powersgd` up (rank 2), `sign` down",
                "cmemi_kn_dedicated_powersgd_sign": "CMEMI, K = N shards on dedicated hosts, `powersgd` up (rank 2), "
                                                    "`sign` down",
                "cmemi_k1_powersgd_sign": "CMEMI K = 1, `powersgd` up (rank 2), `sign` down",
                "cmemi_kn_powersgd2_r8": "CMEMI, K = N shards on the worker hosts, `powersgd` both ways (rank 8)",
                "cmemi_kn_dedicated_powersgd2_r8": "CMEMI, K = N shards on dedicated hosts, `powersgd` both ways (rank 8)",
                "cmemi_k1_powersgd2_r8": "CMEMI K = 1, `powersgd` both ways (rank 8)"}
BOTH_WAYS_GOALS = {"powersgd": 1.0, "topk": 1.5}  # issue 32: × DDP + PowerSGD hook, at N = 4 and 8


def cluster() -> str:
    """bench/cluster.py: N emulated hosts on shaped links, DDP against CMEMI with one aggregator (optional file)."""
    if not (RESULTS / "cluster.json").is_file():
        return "No results yet: `sudo .venv/bin/python bench/cluster.py --out bench/results/cluster.json` writes them."
    d = load("cluster")
    m, w = d["machine"], d["workload"]
    loads = [m["loadavg_at_start"][0], m["loadavg_at_end"][0]]
    links = {n: x.get("link", d["link"]) for n, x in d["by_n"].items()}
    probes = [v / (link["rate_bit_s"] / 1e6) * 100 for link in links.values() for v in link["probe_mbit_s"].values()]
    rates = ", ".join(f"{link['rate']} at N = {n}" for n, link in links.items())
    lines = [f"Measured with `{d['command']}` on {m['cpus']} CPU cores (1-minute load average "
             f"{span(loads, '{:.1f}')} at start and end), torch {m['torch']}: every link shaped each way to {rates} "
             f"(`tc tbf`; TCP probes got {span(probes, '{:.0f}')} % of the rate), the MLP "
             f"784-512-512-10 ({w['param_bytes'] / 1e6:.2f} MB), batch {w['batch_per_worker']} per worker, "
             f"{w['emulated_compute_ms_per_forward']:.0f} ms of emulated compute per forward, {w['steps']} steps per "
             "run; ms/step = median after warm-up. Bound = communication at the link rate plus the emulated compute "
             "(ring all-reduce for DDP; a single server receiving N gradients, then sending N parameter sets, for "
             "CMEMI K = 1; each host's N−1 slices out and in for K = N co-located shards; one gradient out and one parameter "
             "set in, overlapped, for K = N dedicated servers; with a codec the N dense parameter sets alone, since parameters go back uncompressed; none for rows compressed both ways). CPU = the machine's idle cores / cores busy in the run's own processes, over its measured "
             "steps.", "",
             "| N | system | ms/step | samples/s | × DDP dense | bound | CPU idle / used |", "|---|---|---|---|---|---|---|"]
    for n, x in d["by_n"].items():
        bounds = x["bounds_with_compute_s"]
        ddp = x["runs"].get("ddp", {}).get("step_time_median_s")
        for key, what in CLUSTER_ROWS.items():
            r = x["runs"].get(key)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {n} | {what} | failed: {r['error'].splitlines()[0][:120]} | | | | |")
                continue
            t = r["step_time_median_s"]
            bound = {"ddp": f"{bounds['ring_allreduce_s'] * 1000:.0f} ms",
                     "cmemi_k1": f"{bounds['single_server_sequential_s'] * 1000:.0f} ms",
                     "cmemi_kn": (f"{bounds['colocated_shards_full_duplex_s'] * 1000:.0f} ms"
                                  if "colocated_shards_full_duplex_s" in bounds else ""),
                     "cmemi_kn_dedicated": (f"{bounds['dedicated_servers_full_duplex_s'] * 1000:.0f} ms"
                                            if "dedicated_servers_full_duplex_s" in bounds else ""),
                     "cmemi_kn_pipelined": (f"{bounds['dedicated_servers_full_duplex_s'] * 1000:.0f} ms"
                                            if "dedicated_servers_full_duplex_s" in bounds else ""),
                     "cmemi_kn_nocurve": (f"{bounds['colocated_shards_full_duplex_s'] * 1000:.0f} ms"
                                          if "colocated_shards_full_duplex_s" in bounds else ""),
                     "cmemi_kn_powersgd": (f"≥ {bounds['colocated_shards_params_only_s'] * 1000:.0f} ms"
                                           if "colocated_shards_params_only_s" in bounds else ""),
                     "cmemi_k1_powersgd": f"≥ {bounds['single_server_full_duplex_s'] * 1000:.0f} ms",
                     "cmemi_k1_topk": f"≥ {bounds['single_server_full_duplex_s'] * 1000:.0f} ms"}.get(key, "")
            vs = "1" if key == "ddp" else (f"{t / ddp:.2f}" if ddp else "")
            cpu = r.get("cpu", {})
            cpu_s = (f"{cpu['machine_idle_cores']:.2f} / {cpu['this_run_cores_busy']:.2f}"
                     if cpu.get("machine_idle_cores") is not None else "")
            lines.append(f"| {n} | {what} | {t * 1000:.0f} | {r['samples_per_s']:.0f} | {vs} | {bound} | {cpu_s} |")
    ratios = [x["ratios"] for x in d["by_n"].values()]
    ddp_b = [r["ddp_vs_ring_bound"] for r in ratios if r.get("ddp_vs_ring_bound")]
    cm_b = [r["cmemi_k1_vs_single_server_sequential_bound"] for r in ratios
            if r.get("cmemi_k1_vs_single_server_sequential_bound")]
    ddp_cpu = [x["runs"]["ddp"]["cpu"] for x in d["by_n"].values() if "cpu" in x["runs"].get("ddp", {})]
    every_cpu = [r["cpu"] for x in d["by_n"].values() for r in x["runs"].values() if "machine_idle_cores" in
                 r.get("cpu", {})]
    least_idle = min((c["machine_idle_cores"] for c in every_cpu), default=0.0)
    if ddp_b and cm_b and least_idle >= 0.5:
        lines += ["", f"DDP dense took {span(ddp_b, '{:.2f}')}× its bound and CMEMI K = 1 dense "
                  f"{span(cm_b, '{:.2f}')}× its own. Every run left at least {least_idle:.2f} of the 2 cores idle "
                  "(CPU column): the links, not the shared CPU, were the limit."]
    elif ddp_b and cm_b and ddp_cpu:
        idle = max(c.get("machine_idle_cores") or 0 for c in ddp_cpu)
        peak = max(c["loadavg_1min"][1] for c in ddp_cpu if "loadavg_1min" in c)
        lines += ["", f"DDP dense took {span(ddp_b, '{:.2f}')}× its bound and CMEMI K = 1 dense "
                  f"{span(cm_b, '{:.2f}')}× its own. During the DDP runs the machine had at most {idle:.2f} idle "
                  f"cores (1-minute load average up to {peak:.1f}): DDP's N ranks each compute a real backward pass on "
                  "the 2 shared cores, so where DDP is well above its bound with no idle CPU the excess is CPU "
                  "contention, not the links, and the CMEMI/DDP ratios understate the gap a quiet machine would show."]
    kn = [(n, x["ratios"].get("cmemi_kn_vs_ddp"), x["ratios"].get("cmemi_kn_dedicated_vs_ddp"),
           x["ratios"].get("cmemi_kn_pipelined_vs_ddp"),
           x["runs"].get("cmemi_kn", {}).get("cpu", {}).get("machine_idle_cores")) for n, x in d["by_n"].items()]
    kn = [k for k in kn if k[1] is not None]
    if kn:
        lines += ["", "Sharded (`cluster.shards` = N): " + "; ".join(
            f"N = {n}: {a:.2f}× DDP on the worker hosts" + (f", {b:.2f}× on dedicated hosts" if b else "")
            + (f", {c:.2f}× pipelined on dedicated hosts" if c else "")
            + (f" ({idle:.2f} idle cores during the co-located run)" if idle is not None else "")
            for n, a, b, c, idle in kn) + ". The goals were ≤ 1.05× (co-located) and ≤ 0.7× (dedicated) at N = 8."]
    both = [(n, key, r) for n, x in d["by_n"].items() for key in CLUSTER_ROWS if re.sub(r"_r\d+$", "", key).endswith(("2", "_sign"))
            if (r := x["ratios"].get(f"{key}_vs_ddp_powersgd")) is not None]
    if both:
        lines += ["", "Compressed both ways (`compression.downlink` on), against DDP + PowerSGD hook: "
                  + "; ".join(f"N = {n} {CLUSTER_ROWS[key]}: {r:.2f}×" for n, key, r in both)
                  + ". The goals were ≤ " + " and ≤ ".join(f"{g}× with `{c}`" for c, g in BOTH_WAYS_GOALS.items())
                  + " at N = 4 and 8."]
    return "\n".join([*lines, *cluster_profile(d), "", measured("cluster")])


def cluster_profile(d: dict[str, Any]) -> list[str]:
    """Where a run's CPU goes per step at the largest N (bench/cluster.py's CpuSampler), for every system."""
    n, x = max(d["by_n"].items(), key=lambda kv: int(kv[0]))
    rows = {k: r for k, r in x["runs"].items() if "ms_per_step_by_role" in r.get("cpu", {})}
    if not rows:
        return []
    roles = sorted({role for r in rows.values() for role in r["cpu"]["ms_per_step_by_role"]})
    head = ["system", "ms/step", *roles, "machine: user", "system", "softirq", "idle", "tbf drops up / down"]
    lines = ["", f"Where the CPU goes at N = {n} (CPU milliseconds per step, summed over the run's processes of each "
             "role; the machine's user/system/softirq/idle over the same steps, from /proc/stat: softirq and "
             "system are mostly the kernel carrying the emulated network; tbf drops: packets per step the shaped "
             "queues dropped, uplinks and downlinks summed):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, r in rows.items():
        cpu = r["cpu"]
        by_role, mach = cpu["ms_per_step_by_role"], cpu["ms_per_step_machine"]
        cells = [CLUSTER_ROWS.get(key, key), f"{r['step_time_median_s'] * 1000:.0f}",
                 *(f"{by_role[role]:.0f}" if role in by_role else "" for role in roles),
                 *(f"{mach.get(f, 0):.0f}" for f in ("user", "system", "softirq", "idle")),
                 (f"{r['link_drops']['up'] / r['steps']:.0f} / {r['link_drops']['down'] / r['steps']:.0f}"
                  if "link_drops" in r else "")]
        lines.append("| " + " | ".join(cells) + " |")
    ddp, kn = rows.get("ddp"), rows.get("cmemi_kn")
    if ddp is not None and kn is not None:
        def used(r: dict[str, Any]) -> float:
            return sum(r["cpu"]["ms_per_step_by_role"].values())

        def kernel(r: dict[str, Any]) -> float:
            return r["cpu"]["ms_per_step_machine"].get("system", 0) + r["cpu"]["ms_per_step_machine"].get("softirq", 0)
        roles = kn["cpu"]["ms_per_step_by_role"]
        servers = sum(v for k, v in roles.items() if "shard" in k)
        idle = min(ddp["cpu"]["machine_idle_cores"], kn["cpu"]["machine_idle_cores"])
        bound = ("both systems were CPU-bound on the 2 cores (idle column)" if idle < 0.3 else
                 f"the CPU was not the limit ({idle:.2f} or more idle cores in both runs)")
        lines += ["", f"At N = {n} {bound}. DDP's ranks used {used(ddp):.0f} CPU-ms per step (their real backward "
                  f"passes included), CMEMI's co-located run {used(kn):.0f} ({used(kn) / used(ddp):.2f}×): its "
                  f"workers {roles.get('worker', 0):.0f} and its {n} shard processes {servers:.0f}, which receive, "
                  "check, sum, step and send every byte a second time in user space, where a ring all-reduce passes "
                  "each chunk from rank to rank once. The kernel's share (system + softirq: the emulated links, "
                  f"about the same bytes for both) was {kernel(kn):.0f} CPU-ms per step against DDP's {kernel(ddp):.0f}."]
        if (plain := rows.get("cmemi_kn_nocurve")) is not None:
            lines[-1] += (f" Without CurveZMQ (gloo encrypts nothing) the step took {plain['step_time_median_s'] * 1000:.0f}"
                          f" ms instead of {kn['step_time_median_s'] * 1000:.0f}.")
    return lines


def cluster_notes() -> str:
    """The prose under the cluster table: where the sharded rows lose to their bounds, from bench/results/cluster.json."""
    if not (RESULTS / "cluster.json").is_file():
        return ""
    d = load("cluster")
    by = d["by_n"]
    ns = list(by)
    top = max(ns, key=int)

    def run(n: str, key: str) -> dict[str, Any]:
        r = by[n]["runs"].get(key, {})
        return {} if "error" in r else r

    def idle(*keys: str) -> list[float]:
        return [c for n in ns for k in keys if (c := run(n, k).get("cpu", {}).get("machine_idle_cores")) is not None]

    rates = " / ".join(by[n].get("link", d["link"])["rate"] for n in ns)
    cc = d["link"].get("tcp_congestion_control")
    two_phase, ddp_idle, pipe_idle = idle("cmemi_kn", "cmemi_kn_dedicated"), idle("ddp"), idle("cmemi_kn_pipelined")
    out = [f"Where the sharded rows lose to their bounds. The link rate falls with N ({rates} at N = {' / '.join(ns)}) "
           "so that the 2 cores are not the limit"
           + (f": the two-phase sharded runs left {span(two_phase, '{:.2f}')} cores idle, DDP "
              f"{span(ddp_idle, '{:.2f}')}, the pipelined runs {span(pipe_idle, '{:.2f}')} (CPU column)"
              if two_phase and ddp_idle and pipe_idle else "") + "."
           + (f" Every host uses {cc} (`--tcp-cc`), Linux's default congestion control: this machine's own default, "
              "BBRv1, ignores losses, and a worker's many flows into one shaped queue then lost far more packets "
              "(seen while building this bench; not in a results file)." if cc else ""), ""]
    pipe = [(n, run(n, "cmemi_kn_pipelined").get("step_time_median_s"), run(n, "cmemi_kn_dedicated").get(
        "step_time_median_s")) for n in ns]
    pipe = [(n, p, q) for n, p, q in pipe if p and q]
    r_top = by[top]["ratios"].get("cmemi_kn_pipelined_vs_ddp")
    if pipe and r_top:
        top_run = run(top, "cmemi_kn_pipelined")
        bound = by[top]["bounds_with_compute_s"]["dedicated_servers_full_duplex_s"]
        shard_ms = top_run.get("cpu", {}).get("ms_per_step_by_role", {}).get("shard k > 0")
        drops = top_run.get("link_drops", {}).get("up")
        stages = d.get("pipeline_stages")
        less = [(1 - p / q) * 100 for _, p, q in pipe]
        goal = "met" if r_top <= 0.7 else f"missed by {(r_top / 0.7 - 1) * 100:.0f} %"
        out.append(
            f"- **Pipelined steps {'pay ' if all(p < q for _, p, q in pipe) else ''}on dedicated hosts**: "
            f"{' / '.join(f'{p * 1000:.0f}' for _, p, _ in pipe)} ms against "
            f"{' / '.join(f'{q * 1000:.0f}' for _, _, q in pipe)} ms two-phase at N = {' / '.join(n for n, _, _ in pipe)}, "
            f"{span(less)} % less, and {r_top:.2f}× DDP at N = {top}. The goal (≤ 0.7×) is {goal}, and the row is "
            f"{top_run['step_time_median_s'] / bound:.1f}× its bound. What is left, not profiled further: the barrier "
            "every step still has (the leader commits, and leases the next step, only after every shard's last "
            "stage; the links idle meanwhile, and during the "
            f"{d['workload']['emulated_compute_ms_per_forward']:.0f} ms of compute), the shards' interpreter"
            + (f" ({shard_ms:.0f} CPU-ms per step for {top} shards: each handles {top} workers"
               + (f" × {stages} stages" if stages else "'s stages") + " each way)" if shard_ms is not None else "")
            + f", and a worker's {int(top) + 1} TCP flows sharing one queue"
            + (f" ({drops / top_run['steps']:.0f} packets dropped per step)" if drops is not None else "") + ".")
    kn = [by[n]["ratios"].get("cmemi_kn_vs_ddp") for n in ns]
    kn_idle = run(top, "cmemi_kn").get("cpu", {}).get("machine_idle_cores")
    if all(kn) and kn_idle is not None:
        out.append(
            f"- **Co-located shards** ({span(kn, '{:.2f}')}× DDP, goal ≤ 1.05×) are "
            f"{'not CPU-bound' if kn_idle >= 0.3 else 'CPU-bound'} here ({kn_idle:.2f} idle cores at N = {top}): what "
            "remains is the two-phase structure, the push, then the commit round trip, then the pull, each phase as "
            "slow as its slowest host; pipelining them was not measured, and should help little, because a host's "
            "uplink carries its gradient slices and its parameter slices either way.")
    k1 = [(n, r) for n in ns if (r := run(n, "cmemi_k1")).get("bytes_to_workers_per_step")]
    if k1 and all(r.get("duplicate_param_sends") is not None for _, r in k1):
        pb = d["workload"]["param_bytes"]
        out.append(
            "- **K = 1 dense, bytes per step against the ideal** (N parameter sets down, N gradients up): "
            + "; ".join(f"N = {n}: {(r['bytes_to_workers_per_step'] + r['bytes_from_workers_per_step']) / (2 * int(n) * pb):.2f}×"
                        f" ({r['duplicate_param_sends']} parameter sets sent twice)" for n, r in k1)
            + ". A worker that hears nothing for 2 × `cluster.dead_after` asks again; while its last work is still "
            "on its way the leader answers `pending` instead of sending the parameters again (docs/design.md §2).")
    for n in ns:
        if "error" in (failed := by[n]["runs"].get("cmemi_k1", {})):
            send = by[n]["bounds_comm_only_s"]["single_server_full_duplex_s"]
            out.append(f"- **K = 1 at N = {n} failed** (the table's row; one server needs {send:.1f} s to send {n} "
                       f"parameter sets at {by[n]['link']['rate']}): {failed['error'].splitlines()[0][:200]}")
    out.append("- `powersgd` up only cannot reach 0.3× DDP dense: only the gradients shrink, and the dense parameters "
               "each worker pulls back alone take longer than 0.3× DDP's step at this link rate (the `≥` bound of that "
               "row); DDP's PowerSGD hook has no parameters to send because every rank steps its own replica.")
    both = [(n, a["step_time_median_s"] / b["step_time_median_s"]) for n in ns
            if (a := run(n, "cmemi_kn_powersgd2")).get("step_time_median_s") and (b := run(n, "ddp")).get("step_time_median_s")]
    if both:
        out.append("- `powersgd` both ways (`compression.downlink: powersgd`, whole tensors factored: docs/design.md §9), "
                   "K = N, against DDP dense: " + "; ".join(f"N = {n}: {r:.2f}×" for n, r in both) + ".")
    return "\n".join(out)


def resnet_accuracy() -> str:
    """The ResNet example's accuracy line, from docs/resnet_accuracy.json (scripts/resnet_accuracy.py)."""
    d = load_path(RESNET)

    def pct(xs: list[float]) -> str:
        return " / ".join(f"{x * 100:.1f}" for x in xs)

    return (f"- **Accuracy of the example** (`{d.get('command', 'python scripts/resnet_accuracy.py')}`, "
            f"seeds {', '.join(map(str, d['seeds']))}, test accuracy in eval mode): CMEMI (`cmemi reference`, bitwise "
            f"`cmemi up`) {pct(d['cmemi_reference'])} %, mean **{d['cmemi_mean'] * 100:.1f} %**; a plain PyTorch loop "
            f"(tests/helpers/plain.py) {pct(d['plain_pytorch'])} %, mean **{d['plain_mean'] * 100:.1f} %**. "
            + measured(paths=(RESNET,)))


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


TABLES: dict[str, Callable[[], str]] = {"bench-table": benchmark, "compression-table": compression,
                                        "streaming-table": streaming,
                                        "scaling-table": scaling, "memory-table": memory, "small-table": small, "cluster-table": cluster,
                                        "cluster-notes": cluster_notes, "resnet-accuracy": resnet_accuracy,
                                        "local-steps-table": local_steps}


def block_bounds(text: str, name: str) -> tuple[int, int]:
    """(start, end) of the generated content between NAME's markers."""
    start = text.index(f"<!-- {name}:start")
    return text.index("\n", start) + 1, text.index(f"<!-- {name}:end")


def blocks(text: str) -> dict[str, str]:
    out = {}
    for name in TABLES:
        a, b = block_bounds(text, name)
        out[name] = text[a:b].strip()
    return out


def regenerate(text: str) -> str:
    check_all()
    for name, make in TABLES.items():
        a, b = block_bounds(text, name)
        text = text[:a] + make() + "\n" + text[b:]
    return text


def main(argv: list[str]) -> int:
    text = README.read_text()
    try:
        new = regenerate(text)
    except ProvenanceError as exc:
        print(f"readme_tables: {exc}", file=sys.stderr)
        return 2
    if "--check" in argv:
        if new != text:
            print("README.md figure tables differ from bench/results: run " + GENERATOR, file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
