"""The benchmark overview's tables: overhead, transport, recovery, checkpoints and scaling (`make bench`'s
results files), for docs/benchmarks/index.md."""

from __future__ import annotations

from scripts.tables.provenance import load, measured, ms, sec, span


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
            "see [Scaling out](../guides/scaling-out.md))",
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
