"""Issue 48's home-links table: local steps on the emulated cluster at home link rates (20-50 Mbit/s), every
`bench/results/cluster_home*.json` (bench/cluster.py with `--rate`), each system's samples/s against the compute
bound: N hosts x one host's compute-only rate (the emulated one: 20 ms per 64-sample microbatch; and, with
`--compute-bound`, the same system measured in the same run with its links at 10 Gbit/s). Issue 48's goal is 90 %."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scripts.tables.provenance import RESULTS, load_path, measured

SYSTEMS = {
    "cmemi_local": "whole rounds, states spread",
    "cmemi_local_leaderstates": "whole rounds, states on the leader",
    "cmemi_local_int8_down": "whole rounds, int8 up + int8 θ down",
    "cmemi_local_stream": "streaming F = 4, states spread",
    "cmemi_local_stream_leaderstates": "streaming F = 4, states on the leader",
    "cmemi_local_rare": "whole rounds, int4 up + DOWN θ down, K = 1, a state every D rounds",
    "cmemi_local_rare_every": "whole rounds, int4 up + DOWN θ down, K = 1, a state every round",
    "cmemi_local_rare_kn": "whole rounds, int4 up + DOWN θ down, K = N, a state every D rounds",
    "cmemi_kn": "synchronous, dense, K = N (the bytes goal's baseline)",
}


def system_name(name: str, described: str = "") -> str:
    """The table's name of a system; `described`: the results file's description of it, which names
    cmemi_local_rare's D (bench/cluster.py --state-every) and its compression.downlink."""
    base, nolog = (name[: -len("_nolog")], True) if name.endswith("_nolog") else (name, False)
    text = SYSTEMS.get(base, f"`{base}`") + (", step log off" if nolog else "")
    if (d := re.search(r"train\.state_every (\d+)", described)) and " D " in text:
        text = text.replace(" D ", f" D = {d.group(1)} ")
    down = re.search(r"compression\.downlink (\w+)", described)
    return text.replace("DOWN", down.group(1) if down else "int8")  # (cmemi_local_rare's first results: int8)


def described(d: dict[str, Any], name: str) -> str:
    """A results file's description of system `name`; cmemi_local_rare_kn's is cmemi_local_rare's at K = N, whose
    description names D and the downlink."""
    systems = d.get("systems", {})
    base = "cmemi_local_rare" if name.startswith("cmemi_local_rare_kn") else name
    return f"{systems.get(name, '')} {systems.get(base, '') if base != name else ''}"


def share(x: Any) -> str:
    return "—" if x is None else f"{x:.0%}"


def each_run(files: list[Path]) -> Iterator[tuple[Path, dict[str, Any], str, dict[str, Any], str, dict[str, Any]]]:
    """(file, its results, N, that N's results, system, its run) for every run of the home-links files."""
    for path in files:
        d = load_path(path)
        for n, x in d["by_n"].items():
            for name, run in x["runs"].items():
                yield path, d, n, x, name, run


def slow_host(r: dict[str, Any], n: int) -> str:
    """The run again with one host's link at a fraction f of the others' (bench/cluster.py --slow-host): f, the
    run's samples/s against the all-fast run's, and issue 48's goal for it, (N - 1 + f) / N."""
    if "slow_host_vs_all_fast" not in r:
        return "—"
    fraction = r["slow_host_goal"] * n - (n - 1)
    return f"{fraction:.2g}: {share(r['slow_host_vs_all_fast'])} (goal {share(r['slow_host_goal'])})"


def home() -> str:
    files = sorted(RESULTS.glob("cluster_home*.json"))
    lines = ["| results file | N | link | system | samples/s | s per step (round / segment) | of the emulated compute "
             "bound | of the measured compute bound | bytes/sample | packets dropped at the server host's downlink | one slow host (`--slow-host`): its link's share, "
             "samples/s of the all-fast run (goal) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, d, n, x, name, r in each_run(files):
        if "samples_per_s" not in r:
            continue
        emulated = r.get("of_emulated_compute_bound")
        if emulated is None:  # a run without --compute-bound: the same bound from the workload
            w = d["workload"]
            per_host = 1000 * w["batch_per_worker"] / w["emulated_compute_ms_per_forward"]
            emulated = r["samples_per_s"] / (int(n) * per_host)
        drops = r.get("link_drops", {}).get("by_host", {}).get("srv", {}).get("down")
        lines.append(f"| `{path.name}` | {n} | {x['link']['rate']} | {system_name(name, described(d, name))} | "
                     f"{r['samples_per_s']:,.0f} | {r['step_time_median_s']:.2f} | "
                     f"{share(emulated)} | {share(r.get('of_measured_compute_bound'))} | "
                     f"{r['bytes_per_sample']:,.0f} | {'—' if drops is None else f'{drops:,}'} | {slow_host(r, int(n))} |")
    return "\n".join([*lines, "", measured(paths=tuple(files))])


def _secs(x: Any) -> str:
    return "—" if x is None else f"{x:.2f}"


def home_rounds() -> str:
    """Where a round's time goes (bench/cluster.py --timeline, bench/round_timeline.py), each run beside its
    --compute-bound rerun at 10 Gbit/s, with the cores the run got and its CPU-seconds a round by role."""
    files = sorted({path for path, *_, run in each_run(sorted(RESULTS.glob("cluster_home*.json"))) if "timeline" in run})
    lines = ["| results file | N | link | system | rounds | s a round | θ out to the last worker | its intake | compute, "
             "shortest – longest | barrier (ends' spread) | Δ encoded | last Δ up, without / with a state | leader, "
             "last Δ to the next leases | slowest worker not computing | cores the run got | CPU-s a round: workers / "
             "leader / coordinator / checkpointer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, d, n, x, name, run in each_run(files):
        for r, link in ((run, x["link"]["rate"]), (run.get("compute_bound", {}), "10gbit (compute bound)")):
            t = r.get("timeline")
            if not t or not t.get("steps"):
                continue
            cpu = r.get("cpu", {})
            role = cpu.get("ms_per_step_by_role", {})
            by = " / ".join(_secs(role.get(k, 0) / 1000) for k in ("worker", "leader (shard 0)", "coordinator",
                                                                    "checkpointer"))
            lines.append(
                f"| `{path.name}` | {n} | {link} | {system_name(name, described(d, name))} | "
                f"{t['steps']} | {_secs(t['step_s'])} | {_secs(t['params_out_last_s'])} | {_secs(t['intake_s'])} | "
                f"{_secs(t['compute_min_s'])} – {_secs(t['compute_max_s'])} | {_secs(t['barrier_s'])} | "
                f"{_secs(t['encode_s'])} | {_secs(t['last_up_without_s'])} / {_secs(t['last_up_with_a_state_s'])} | "
                f"{_secs(t['leader_s'])} | {_secs(t['not_computing_s'])} | "
                f"{cpu.get('this_run_cores_busy', '—')} of {cpu.get('cpus', '—')} | {by} |")
    return "\n".join([*lines, "", measured(paths=tuple(files))])
