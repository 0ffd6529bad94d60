"""The soak's table (bench/soak.py, `make soak`: bench/results/soak.json) for docs/concepts/faults.md: faults by kind
and role, restarts, steps redone, double faults, fencing violations and params_sha256 against `cmemi reference`.

A result rebuilt by `bench/soak.py --rescore` (the soak died before writing it) says so (`rescored`): its restarts
are those the run's events recorded (a lower bound), its exit codes were not recorded (the libzmq aborts are counted
from the services' logs instead), and its wall time is the run's own, the soak's being unknown."""

from __future__ import annotations

from collections import Counter
from typing import Any

from scripts.tables.provenance import load, measured

ROLES = ("coordinator", "leader", "shard", "checkpointer", "worker", "redis")


def timing(d: dict[str, Any]) -> str:
    if d.get("wall_s") is not None:
        return f"the soak (its reference run included) over in {d['wall_s']:.0f} s"
    return (f"the run itself over in {d['run_s']:.0f} s from its first process's start" if d.get("run_s") is not None
            else "the soak's wall time unknown")


def restarted(d: dict[str, Any]) -> str:
    """The restarts and, of the exits, the aborts inside libzmq (SIGABRT: exit -6, or its assertion line in a log)."""
    if d.get("exit_codes") is not None:
        aborts, where = sum(n for k, n in d["exit_codes"].items() if k.endswith("=-6")), ""
    else:
        aborts, where = sum(d.get("aborts_logged", {}).values()), "; counted from their assertion lines in the logs"
    if d.get("restarts") is None:
        return f"Processes restarted: not recorded; {aborts} aborts inside libzmq{where}"
    restarts = ", ".join(f"{k} {n}" for k, n in sorted(d["restarts"].items())) or "none"
    lead = ("Processes restarted (at least: starts announced in events.jsonl)" if d.get("rescored")
            else "Processes restarted")
    return (f"{lead}: {restarts}; of their exits, {aborts} were aborts inside libzmq (SIGABRT, "
            f"[below](#libzmq-aborts){where}), restarted like any crash")


def rescored(d: dict[str, Any]) -> list[str]:
    """A sentence on where a rescored result came from (empty for a soak that wrote its own)."""
    if not d.get("rescored"):
        return []
    return [f"Rebuilt with `bench/soak.py --rescore` from the run's folder and the soak's log: "
            f"{d['rescored']['why'][:240]}.", ""]


def soak() -> str:
    """One row per fault kind, one column per role (how many of that kind hit that role), then the run's outcome."""
    d = load("soak")
    by = Counter(d["by_kind_role"])
    kinds = sorted(d["by_kind"], key=lambda k: -d["by_kind"][k])
    roles = [r for r in ROLES if any(by[f"{k}:{r}"] for k in kinds)]
    lines = ["| fault | " + " | ".join(roles) + " | all |", "|---|" + "---|" * (len(roles) + 1)]
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(str(by[f'{k}:{r}']) for r in roles) + f" | {d['by_kind'][k]} |")
    lines.append("| **all** | " + " | ".join(str(sum(by[f'{k}:{r}'] for k in kinds)) for r in roles)
                 + f" | **{d['faults']}** |")
    outcome = "equal to" if d["bitwise_equal"] else "**different from**"
    return "\n".join([
        f"`{d['command']}`: {d['hosts']} emulated hosts, K = {d['shards']}, {d['workers']} workers, {d['steps']} steps, "
        f"seed {d['seed']}; {d['faults']} faults ({d['faults_missed']} more missed) in {d['faults_s']:.0f} s, "
        f"{timing(d)}.", "",
        *rescored(d),
        *lines, "",
        f"{restarted(d)}. Steps redone (step numbers logged more than once in metrics.jsonl): "
        f"{d['steps_redone']}" + (f"; fallbacks to a checkpoint: {d['redone_events']}, of them after the checkpointer's "
                                  f"restart lost the step log and a server died before a checkpoint covered it (a "
                                  f"double fault): {d['double_faults_log_lost']} ({d['steps_redone_double']} steps by "
                                  "their `steps_redone` events)" if "redone_events" in d else "") +
        "; double faults (a server killed within `DOUBLE_S` of another server's kill, or dead before a checkpoint "
        f"covered the step log a checkpointer's restart lost): {d['double_faults']}; terms: {d['terms']}; fencing violations: {len(d['violations'])}. Final params_sha256 "
        f"{outcome} `cmemi reference`" + (f"; the run did not finish: {d['error'].splitlines()[0][:200]}"
                                          if d.get("error") else "") + ".", "",
        measured("soak")])
