"""The emulated cluster's table and the notes on where its rows lose to their bounds (bench/cluster.py as root),
for docs/benchmarks/cluster.md."""

from __future__ import annotations

import re
from typing import Any

from scripts.tables import provenance
from scripts.tables.provenance import load, measured, span

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
    if not (provenance.RESULTS / "cluster.json").is_file():
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
    if not (provenance.RESULTS / "cluster.json").is_file():
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
