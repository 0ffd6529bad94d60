"""The step log's table (bench/recovery.py --parts steplog: bench/results/recovery_steplog.json, checkpoints every
20 steps, and recovery_steplog_every1000.json) for docs/design/step-log.md, and its README headline: for each server
killed, the steps redone, the seconds from the kill to the next new step and the step time, with the log and
without it (`checkpoint.step_log: false`) in the same run."""

from __future__ import annotations

from typing import Any

from scripts.tables.provenance import load, measured, ms, sec

FILES = ("recovery_steplog", "recovery_steplog_every1000")
WHO = {"leader": "the leader", "shard": "shard 1"}


def rows() -> list[tuple[str, int, int, dict[str, Any]]]:
    """(server, K, checkpoint every, the row) over both files, in file then key order."""
    out = []
    for name in FILES:
        for key, r in load(name)["cmemi_step_log"].items():
            role, k, every = key.split("_")  # e.g. leader_k2_every20
            out.append((role, int(k[1:]), int(every.removeprefix("every")), r))
    return out


def steplog() -> str:
    lines = ["| server SIGKILLed | K | checkpoint every | steps redone, with / without the log | kill → next new step, "
             "with / without | step time, with / without (ratio) |", "|---|---|---|---|---|---|"]
    for role, k, every, r in rows():
        w, wo = r["with_log"], r["without_log"]
        lines.append(f"| {WHO.get(role, role)} ({w['kills']} kills) | {k} | {every} | **{w['steps_redone']}** / "
                     f"{wo['steps_redone']} | {sec(w['kill_to_next_new_step_s_median'], 2)} / "
                     f"{sec(wo['kill_to_next_new_step_s_median'], 2)} | {ms(w['step_time_median_s'])} / "
                     f"{ms(wo['step_time_median_s'])} ({r['step_time_overhead']:.2f}×) |")
    quick = any(load(n).get("quick") for n in FILES)
    return "\n".join([*lines, "", "Medians over the kills; the step time is the median over each run (its kills "
                      "included). The loopback comm-bound MLP of `bench/recovery.py`" + (" (`--quick`)" if quick else "")
                      + ", one process per role on this machine.", "", measured(*FILES)])


def headline() -> str:
    """The README's: the leader killed with checkpoints far apart."""
    role, k, every, r = max((x for x in rows() if x[0] == "leader"), key=lambda x: (x[2], -x[1]))
    return (f"leader SIGKILL with a checkpoint every {every} steps: **{r['with_log']['steps_redone']}** steps redone "
            f"with the step log ({r['without_log']['steps_redone']} without)")


COST_FILES = ("cluster_steplog", "cluster_steplog_k1psgd", "cluster_steplog_frames")  # bench/cluster.py <system>,
# <system>_nolog at N = 8; since cluster_steplog_frames, a compressed step's entry is its encoded gradients (frames.py)
SINCE = {"cluster_steplog_frames": "; entries as the encoded gradients"}
CLUSTER = {"cmemi_k1": "dense, K = 1 (the servers and the checkpointer on one host)",
           "cmemi_k1_powersgd2_r8": "PowerSGD rank 8 both ways, K = 1 (one host)",
           "cmemi_kn": "dense, K = N (shard k on worker host k; the checkpointer on the server host)",
           "cmemi_kn_powersgd2_r8": "PowerSGD rank 8 both ways, K = N (shards on the worker hosts)"}


def steplog_cost() -> str:
    """The log's step-time cost alone, no kills: the loopback comm-bound MLP (bench/steplog_overhead.py, on and off
    alternating in each repeat) and N = 8 emulated hosts (bench/cluster.py, each system and its `_nolog` in one run)."""
    lines = ["| workload | system | step time with / without the log | ratio (issue 47's goal: ≤ 1.05×) |",
             "|---|---|---|---|"]
    loop = load("steplog_overhead")
    for k, rows_ in loop["by_shards"].items():
        r = rows_["head"]
        on = sorted(x["step_time_s"] for x in r["on"])[len(r["on"]) // 2]
        off = sorted(x["step_time_s"] for x in r["off"])[len(r["off"]) // 2]
        lines.append(f"| loopback, comm-bound MLP, {loop['repeats']} repeats | K = {k} | {ms(on)} / {ms(off)} | "
                     f"{r['overhead']:.2f}× (repeats: {', '.join(f'{x:.2f}' for x in r['ratios'])}) |")
    for name in COST_FILES:
        for n, x in load(name)["by_n"].items():
            for system, ratio in x["ratios"].items():
                if not system.endswith("_steplog_overhead"):
                    continue
                base = system.removesuffix("_steplog_overhead")
                on, off = x["runs"][base], x["runs"][base + "_nolog"]
                lines.append(f"| N = {n} emulated hosts, {x['link']['rate']} | {CLUSTER.get(base, base)}"
                             f"{SINCE.get(name, '') if base not in ('cmemi_k1', 'cmemi_kn') else '; the same run'} | "
                             f"{ms(on['step_time_median_s'])} / {ms(off['step_time_median_s'])} | {ratio:.2f}× |")
    return "\n".join([*lines, "", measured("steplog_overhead", *COST_FILES)])
