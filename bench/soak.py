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

    .venv/bin/python bench/soak.py --rescore WORK --log LOG [--reference-summary FILE] --out OUT

rebuilds the result of a soak that died before writing it (tests/helpers/soak_rescore.py) from its `--work` folder
and its stdout; the reference's params_sha256 from FILE (`cmemi reference`'s printed JSON summary first) or, without
it, from running `cmemi reference` on WORK/cluster.yaml. Needs no root; exit codes as above.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from tests.helpers import netns  # noqa: E402
from tests.helpers.netns_soak import soak  # noqa: E402
from tests.helpers.soak_rescore import RescoreError, rescore  # noqa: E402
from tests.helpers.soak_result import reference_timeout, sha_in  # noqa: E402

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
    p.add_argument("--rescore", type=Path, metavar="WORK", help="rebuild the result of the soak run in this --work "
                   "folder instead of running one (with --log; --faults and --seed as that soak was given them)")
    p.add_argument("--log", type=Path, help="--rescore: that soak's stdout (its `[soak T s] fault N: ...` lines)")
    p.add_argument("--reference-summary", type=Path, metavar="FILE", help="--rescore: `cmemi reference "
                   "WORK/cluster.yaml`'s output (its JSON summary first) instead of running it again")
    p.add_argument("--run-commit", metavar="SHA", help="--rescore: the commit that soak ran at (`git rev-parse HEAD` "
                   "in its checkout); the result's own provenance is this checkout's, the rescoring's")
    a = p.parse_args(argv)
    words = " ".join(argv if argv is not None else sys.argv[1:])
    if a.rescore:
        return rescored(a, words)
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
              "command": "sudo .venv/bin/python bench/soak.py " + words, **r}
    return report(result, a.out, a.faults)


def reference_of(a: argparse.Namespace) -> str | None:
    """--rescore: the reference's params_sha256 from --reference-summary (the JSON object `cmemi reference` prints
    first), else from running it on the soak's config with the soak's scaled timeout."""
    if a.reference_summary:
        text = a.reference_summary.read_text()
        summary, _ = json.JSONDecoder().raw_decode(text[text.index("{"):]) if "{" in text else (None, 0)
        if not isinstance(summary, dict) or not sha_in(str(summary.get("params_sha256", ""))):
            raise RescoreError(f"{a.reference_summary} does not start with `cmemi reference`'s JSON summary "
                               "(params_sha256): give that command's output, or leave --reference-summary out")
        return str(summary["params_sha256"])
    cfg = a.rescore / "cluster.yaml"
    import yaml

    steps = int(yaml.safe_load(cfg.read_text())["train"]["steps"])
    r = subprocess.run([sys.executable, "-m", "cmemi", "reference", str(cfg)], cwd=C.ROOT, capture_output=True,
                       text=True, timeout=reference_timeout(steps), check=False)
    if r.returncode != 0:
        raise RescoreError(f"cmemi reference {cfg} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return sha_in(r.stdout)


def rescored(a: argparse.Namespace, words: str) -> int:
    """`--rescore WORK --log LOG`: the result of a soak that died before writing it (tests/helpers/soak_rescore.py)."""
    if not a.log:
        print("bench/soak.py: --rescore needs --log (the soak's stdout)", file=sys.stderr)
        return 2
    if a.run_commit and not re.fullmatch(r"[0-9a-f]{7,40}", a.run_commit):
        print(f"bench/soak.py: --run-commit {a.run_commit!r} is not a commit: give `git rev-parse HEAD` of the "
              "checkout the soak ran from", file=sys.stderr)
        return 2
    measured = C.provenance()
    try:
        r = rescore(a.rescore, a.log, reference=reference_of(a), faults=a.faults, seed=a.seed)
    except (RescoreError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"bench/soak.py --rescore: {exc}", file=sys.stderr)
        return 2
    at = f"at commit {a.run_commit}" if a.run_commit else "at a commit not given (--run-commit)"
    note = (f"the soak's run itself was {at}; this result was rescored from its work folder and log at commit "
            f"{measured['commit']} (bench/soak.py --rescore), which reads its files and runs no training")
    caveat = "rebuilt at that commit (`bench/soak.py --rescore`) from a soak run " + (
        f"at commit `{a.run_commit[:7]}`" if a.run_commit else "at a commit not given")  # scripts/tables: `measured`
    result = {"bench": "soak", **measured, "commit_note": note, "caveat": caveat, "run_commit": a.run_commit,
              "machine": C.machine(),
              "command": ".venv/bin/python bench/soak.py " + words, **r}
    return report(result, a.out, a.faults)


def report(result: dict[str, Any], out: Path, faults: int) -> int:
    """Print the result (less the schedule), write it to `out`, and say in one line whether the soak passed."""
    r = result
    print(json.dumps({k: v for k, v in result.items() if k not in ("schedule", "machine")}, indent=1, default=C.jsonable))
    out.write_text(json.dumps(result, indent=1, default=C.jsonable) + "\n")
    ok = r["bitwise_equal"] and not r["violations"] and r["faults"] >= faults
    print(f"soak: {r['faults']} faults, {r['steps_redone']} steps redone ({r['double_faults']} double faults), "
          f"params_sha256 {'equal to' if r['bitwise_equal'] else 'DIFFERENT FROM'} cmemi reference; "
          f"{len(r['violations'])} fencing violations; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
