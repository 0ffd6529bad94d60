"""The soak's table (bench/soak.py, `make soak`: bench/results/soak.json) for docs/concepts/faults.md: faults by kind
and role, restarts, steps redone, double faults, fencing violations and params_sha256 against `cmemi reference`."""

from __future__ import annotations

from collections import Counter

from scripts.tables.provenance import load, measured

ROLES = ("coordinator", "leader", "shard", "checkpointer", "worker", "redis")


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
    restarts = ", ".join(f"{k} {n}" for k, n in sorted(d["restarts"].items())) or "none"
    aborts = sum(n for k, n in d.get("exit_codes", {}).items() if k.endswith("=-6"))  # SIGABRT: libzmq's assertion
    return "\n".join([
        f"`{d['command']}`: {d['hosts']} emulated hosts, K = {d['shards']}, {d['workers']} workers, {d['steps']} steps, "
        f"seed {d['seed']}; {d['faults']} faults in {d['faults_s']:.0f} s, the soak (its reference run included) over in {d['wall_s']:.0f} s.", "",
        *lines, "",
        f"Processes restarted: {restarts}; of their exits, {aborts} were aborts inside libzmq (SIGABRT, "
        "[below](#libzmq-aborts)), restarted like any crash. Steps redone (step numbers logged more than once in metrics.jsonl): "
        f"{d['steps_redone']}" + (f"; fallbacks to a checkpoint: {d['redone_events']}, of them after the checkpointer's "
                                  f"restart lost the step log and a server died before a checkpoint covered it (a "
                                  f"double fault): {d['double_faults_log_lost']} ({d['steps_redone_double']} steps by "
                                  "their `steps_redone` events)" if "redone_events" in d else "") +
        "; double faults (a server killed within `DOUBLE_S` of another server's kill, or dead before a checkpoint "
        f"covered the step log a checkpointer's restart lost): {d['double_faults']}; terms: {d['terms']}; fencing violations: {len(d['violations'])}. Final params_sha256 "
        f"{outcome} `cmemi reference`" + (f"; the run did not finish: {d['error'].splitlines()[0][:200]}"
                                          if d.get("error") else "") + ".", "",
        measured("soak")])
