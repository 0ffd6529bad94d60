"""bench/recovery.py's step-log rows (issue 47, docs/design/step-log.md): a server SIGKILLed with and without
`checkpoint.step_log`, at `cluster.shards` 1 and 2.

For each (role killed, shards, checkpoint.every_steps) one run with the log and one without, in the same
invocation and on the same config: per kill, the steps redone (step numbers written twice to metrics.jsonl, which is
appended across restarts, one line per step) and the seconds from the kill to the first new step (a step number
above the last one written before the kill; a shard's kill: the first written after its new incarnation was taken in); and the median step time of each run away from its kills, whose
ratio is the log's step-time overhead.

    .venv/bin/python bench/recovery.py --parts steplog [--checkpoint-every 20] [--quick]

Alone (no results file: it prints one JSON object), with each kill's phases from the run's events.jsonl, the
leader or shard 1 SIGKILLed at K = 2 with the log on, this checkout's code and, in the same invocation, another
commit's (`--base`: its tree extracted under runs/, run by this venv's python with that tree first on PYTHONPATH):

    .venv/bin/python bench/recovery_log.py --kill leader --checkpoint-every 1000 --kills 3 --base 2d8e885

The worst kill point, just before a checkpoint (the longest log to replay), at K = 1 (`--out`: the JSON written there
too):

    .venv/bin/python bench/recovery_log.py --kill leader --shards 1 --checkpoint-every 1000 --phase 995 --kills 1 \
        --base COMMIT --out bench/results/recovery_steplog_worst.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (run as a script: bench/ is a package of ROOT)

from bench import common as C  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402

WL = "small"
BIG = 10_000_000  # training "forever": the run is stopped once its kills are measured
WARMUP = 30  # steps left out of the step-time median (start-up)
CALM = 150  # steps before the first kill and after the last one, for the step-time median


def _kill_row(run: C.CmemiRun, role: str, ident: str, after: int, phase: tuple[int, int] | None = None) -> dict[str, Any]:
    """SIGKILL role/ident once the run is `after` steps on (`phase` (p, every): at the first step after that which is p
    modulo every: p = every - 5 is a kill just before a checkpoint, the longest log); wait for a new step past the last
    one before it."""
    target = run.step() + after
    if phase is not None:
        target += (phase[0] - target) % phase[1]
    run.wait_step(target, timeout=600)
    pid, t_kill = run.kill(role, ident)
    step_at_kill = run.step()
    C.log(f"step log bench: killed {role}:{ident} pid {pid} at step {step_at_kill}")
    C.poll(lambda: run.step() > step_at_kill, 240, f"a new step after killing {role}:{ident}", interval=0.01)
    return {"role": role, "id": ident, "pid": pid, "t": t_kill, "step_at_kill": step_at_kill}


def one_run(work: Path, name: str, ident: str, shards: int, every: int, step_log: bool, kills: int,
            phase: int | None = None) -> dict[str, Any]:
    """`ident`: the server killed (aggregator "0", the leader; "1", shard 1). `phase`: each kill at a step that is
    `phase` modulo `every` (default: about half an interval after the previous one)."""
    cfg = C.cmemi_config(name, work / name, WORKLOADS[WL], steps=BIG, microbatches=4, workers=2, spares=0,
                         ckpt_every=every, keep_last=2, shards=shards)
    cfg["checkpoint"]["step_log"] = step_log
    cfg["train"]["log_every"] = 1
    rows = []
    with C.CmemiRun(cfg, work) as run:
        run.wait_step(WARMUP + CALM, timeout=600)  # steps away from any kill: the step time's median
        for i in range(kills):
            rows.append(_kill_row(run, "aggregator", ident, after=max(5, every // 2 + 3 * i),
                                  phase=None if phase is None else (phase, every)))
        run.wait_step(run.step() + CALM, timeout=600)
        time.sleep(0.5)
        run.terminate()
        metrics = [m for m in run.metrics() if "loss" in m and "eval" not in m]
    counts = Counter(m["step"] for m in metrics)
    for r in rows:
        last_before = max((m["step"] for m in metrics if m["t"] < r["t"]), default=0)
        # (a replayed line is not a new step: the restarted leader writes the line of a step its dead incarnation
        # committed without logging it; that came before any step trained after the kill, ~1 s early at K = 2)
        # A shard's kill: only a step written once its new incarnation was taken in counts (issue 47): a step the dead
        # one had done its share of is committed just after the kill (0.002 s) and hid the stall of the next one
        since = max(r["t"], taken_in(run.run_dir, r["t"], ident))
        new = [m for m in metrics if m["t"] > since and m["step"] > last_before and not m.get("replayed")]
        r["last_step_before_kill"] = last_before
        r["kill_to_next_new_step_s"] = new[0]["t"] - r["t"] if new else None
        r["phases_s"] = phases(run.run_dir, r["t"], ident)
    killed_at = [r["t"] for r in rows]
    calm = [m["step_time_s"] for m in metrics if m["step"] > WARMUP and "step_time_s" in m  # (not a replayed line)
            and all(abs(m["t"] - t) > 3.0 for t in killed_at)]
    return {
        "step_log": step_log, "kills": len(rows),
        "steps_redone": sum(k - 1 for k in counts.values() if k > 1),
        "kill_to_next_new_step_s_median": C.rnd(C.median(r["kill_to_next_new_step_s"] for r in rows)),
        "step_time_median_s": C.rnd(C.median(calm)),
        "per_kill": C.rnd(rows),
    }


def rows(work: Path, every: int, kills: int) -> dict[str, Any]:
    """Leader kills at K = 1 and K = 2, shard kills at K = 2: each with and without the log."""
    out: dict[str, Any] = {}
    for ident, shards in (("0", 1), ("0", 2), ("1", 2)):
        key = f"{'leader' if ident == '0' else 'shard'}_k{shards}_every{every}"
        with_log = one_run(work, f"log_{key}", ident, shards, every, True, kills)
        without = one_run(work, f"nolog_{key}", ident, shards, every, False, kills)
        a, b = with_log["step_time_median_s"], without["step_time_median_s"]
        out[key] = {"with_log": with_log, "without_log": without,
                    "step_time_overhead": C.rnd(a / b) if a and b else None}
    return out


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events.jsonl, one dict a line (none if it has none yet)."""
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def taken_in(run_dir: Path, t_kill: float, ident: str) -> float:
    """When the leader took the killed shard's new incarnation into the term (`shard_restarted`, the first after the
    kill); the kill's own time for the leader (every step after its kill is the new leader's) or when there is none
    (without the log the run goes back to a checkpoint in a new term: any later step is new)."""
    events = read_events(run_dir)
    found = next((e["t"] for e in events if ident != "0" and e["t"] > t_kill and e["kind"] == "shard_restarted"
                  and e.get("shard") == int(ident)), None)
    return found if found is not None else t_kill


def phases(run_dir: Path, t_kill: float, ident: str) -> dict[str, float]:
    """Seconds from a kill to each server event that follows it, before the next kill (the first of each kind): the
    coordinator's `died` and `restarted` of the server killed, the leader's replay and advertised term, and shard 1's
    way into the new term: joined in place (`shard_term_joined`) or by an exit, a restart and a replay."""
    events = read_events(run_dir)
    later = [e for e in events if e["t"] > t_kill]
    stop = next((e["t"] for e in later if e["kind"] == "fault_injected" and e["t"] > t_kill + 0.01), float("inf"))
    wanted = {
        "died": lambda e: e["kind"] == "died" and e.get("id") == ident,
        "restarted": lambda e: e["kind"] == "restarted" and e.get("id") == ident,
        "leader_replayed": lambda e: e["kind"] == "step_log_replayed" and e.get("shard") == 0,
        "leader_advertised": lambda e: e["kind"] == "aggregator_started",
        "shard1_joined_in_place": lambda e: e["kind"] == "shard_term_joined" and e.get("shard") == 1,
        "shard1_left_term": lambda e: e["kind"] == "shard_left_term" and e.get("shard") == 1,
        "shard1_exited": lambda e: e["kind"] == "exited" and e.get("id") == "1",
        "shard1_restarted": lambda e: e["kind"] == "restarted" and e.get("id") == "1",
        "shard1_replayed": lambda e: e["kind"] == "step_log_replayed" and e.get("shard") == 1 and not e.get("in_place"),
    }
    out: dict[str, float] = {}
    for name, match in wanted.items():
        found = next((e for e in later if e["t"] < stop and match(e)), None)
        if found is not None:
            out[name] = found["t"] - t_kill
            if "seconds" in found:
                out[name.replace("replayed", "replay_took")] = found["seconds"]
            if name.endswith("_replayed") and "replayed" in found:  # (the entries that replay applied)
                out[f"{name}_entries"] = found["replayed"]
    return out


def base_tree(commit: str) -> Path:
    """`commit`'s tree under runs/, laid out as the installed package maps it (cmemi.shared -> shared/, ...)."""
    root = C.ROOT / "runs" / f"base-{commit}"
    if not root.is_dir():
        root.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(C.ROOT), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        for sub in ("shared", "services", "examples"):
            (root / "cmemi" / sub).symlink_to(f"../{sub}")
    return root


def main() -> None:
    p = argparse.ArgumentParser(description="kill -> next new step at K = 2 with the step log, per phase; prints JSON")
    p.add_argument("--kill", choices=("leader", "shard"), default="leader")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--base", default=None, help="a commit to run too, in the same invocation (before/after)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON here (e.g. bench/results/recovery_steplog_worst.json)")
    p.add_argument("--phase", type=int, default=None,
                   help="kill at a step that is this modulo --checkpoint-every (e.g. 995 of 1000: the longest log)")
    args = p.parse_args()
    C.setup(threads=1)
    work = C.workdir("recovery-log")
    ident = "0" if args.kill == "leader" else "1"
    trees = [("head", C.ROOT)] + ([("base", base_tree(args.base))] if args.base else [])
    out: dict[str, Any] = {"kill": args.kill, "checkpoint_every": args.checkpoint_every, **C.provenance()}
    root = C.ROOT
    try:
        for name, tree in trees:
            C.ROOT = tree  # (the services' code: C.env puts it first on PYTHONPATH)
            run = one_run(work, f"{name}_{args.kill}_every{args.checkpoint_every}", ident, args.shards,
                          args.checkpoint_every, True, args.kills, args.phase)
            keys = sorted({k for r in run["per_kill"] for k in r["phases_s"]})
            run["phases_median_s"] = {k: C.rnd(C.median(r["phases_s"].get(k) for r in run["per_kill"])) for k in keys}
            for way in ("shard1_joined_in_place", "shard1_left_term"):  # how shard 1 came into each new term
                run[f"kills_{way}"] = sum(way in r["phases_s"] for r in run["per_kill"])
            out[name] = run
    finally:
        C.ROOT = root
    text = json.dumps(C.rnd(out), indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
