"""`make soak` (issue 47): >= 1,000 faults of every kind across emulated hosts in one run, then bitwise or exit 1.

    sudo .venv/bin/python bench/soak.py [--faults 1000] [--seed 47] [--steps 40000] [--deadline 2400]

Seven emulated hosts (network namespaces: tests/helpers/netns.py; Redis and the coordinator, the leader, shard 1 of
K = 2, the checkpointer, three workers), faults one after another from a seeded schedule (tests/helpers/
netns_soak.py): SIGKILL and SIGSTOP/SIGCONT of every role, link cuts both ways and one way, 30 % packet loss,
partitions between two hosts, the leader's port blocked. Prints and writes bench/results/soak.json (with the commit
it measured): faults by kind and role, restarts, steps redone, double faults apart, and params_sha256 against
`cmemi reference` of the same config. Exit 1 when the result is not bitwise equal, when metrics.jsonl shows a
step committed under a term after a newer term took over (or two results for one step), or when fewer faults hit
than asked (the run ended first: raise --steps); 2 when it cannot run here (not root, no `ip netns`). Bounded:
`--deadline` seconds for the faults and the run's end, then `cmemi reference` of the same config (minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from tests.helpers import netns  # noqa: E402
from tests.helpers.netns_soak import soak  # noqa: E402

OUT = C.ROOT / "bench" / "results" / "soak.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=1000)
    p.add_argument("--seed", type=int, default=47)
    p.add_argument("--steps", type=int, default=40000, help="long enough that the run outlives the schedule (faults stall it: a 151-fault soak trained ~12 steps/s while faulted)")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between one fault's heal and the next fault")
    p.add_argument("--deadline", type=float, default=2400, help="seconds for the whole soak; exit 1 past it")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--work", type=Path, help="keep the run (logs, metrics.jsonl, events.jsonl) in this new folder")
    a = p.parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"bench/soak.py: {why}; run it as root on Linux with iproute2 and iptables", file=sys.stderr)
        return 2
    measured = C.provenance()  # the commit the soak runs, read before it starts
    lab = netns.NetLab()
    try:
        with tempfile.TemporaryDirectory(prefix="cmemi-soak-") as tmp:
            work = a.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            try:
                r = soak(lab, work, a.faults, a.seed, a.steps, gap=a.gap, deadline_s=a.deadline)
            except (TimeoutError, AssertionError) as exc:
                print(f"soak failed: {str(exc)[-6000:]}", file=sys.stderr)
                return 1
    finally:
        lab.close()
    result = {"bench": "soak", **measured, "machine": C.machine(),
              "command": "sudo .venv/bin/python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              **r}
    print(json.dumps({k: v for k, v in result.items() if k not in ("schedule", "machine")}, indent=1, default=C.jsonable))
    a.out.write_text(json.dumps(result, indent=1, default=C.jsonable) + "\n")
    ok = r["bitwise_equal"] and not r["violations"] and r["faults"] >= a.faults
    print(f"soak: {r['faults']} faults, {r['steps_redone']} steps redone ({r['double_faults']} double faults), "
          f"params_sha256 {'equal to' if r['bitwise_equal'] else 'DIFFERENT FROM'} cmemi reference; "
          f"{len(r['violations'])} fencing violations; wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
