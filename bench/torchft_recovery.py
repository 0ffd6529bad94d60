"""Recovery from replica kills under torchft (per-step fault tolerance), for comparison with recovery.py.

A torchft lighthouse (min_replicas 1) and 2 replica groups of one process each (bench/torchft_train.py: the
"small" workload of recovery.py, CPU, gloo, 1 thread; each step's global batch split over the 2 groups).
After warm-up, replica 1 is SIGKILLed K times and restarted at once, like an orchestrator would (a new
process with the same replica id), each time only after the previous incarnation rejoined and trained again
with both groups. Per kill, from the step logs (wall-clock `t`, manager.current_step(), num_participants()):

- survivor stall: the longest gap between consecutive committed steps of replica 0 from its last step
  before the kill to its first step with both replicas again, and whether it kept stepping meanwhile;
- rejoin: kill -> the restarted replica's first committed step (process start, torch import, manager and
  quorum, healing from replica 0 over HTTP), with the intermediate marks (process start, manager ready);
- the killed replica's steps: its last step before the kill vs its first step after the restart (steps it
  redid / skipped: a healed replica resumes at the survivor's current step);
- steps trained with a replica's samples missing: the survivor's steps while replica 1 was down or healing
  committed with num_participants() == 1 (that step's other half of the global batch is never trained).

The whole measurement runs once per lighthouse heartbeat timeout (`--heartbeat-timeouts-ms`, default
5000 = torchft's default, and 1000): how long the lighthouse takes to declare the dead replica gone decides
whether the survivor waits for the restarted replica or trains on alone.

    .venv/bin/python bench/torchft_recovery.py [--quick] [--kills K] [--heartbeat-timeouts-ms 5000,1000]

Prints one JSON object (with "skipped" when torchft cannot be imported).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402

WL = "small"
TRAIN = C.ROOT / "bench" / "torchft_train.py"
# lighthouse settings: those of torchft's README (`torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
# --join_timeout_ms 10000`), heartbeat timeout at the torchft default
LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10_000, "heartbeat_timeout_ms": 5_000}


# ---------------------------------------------------------------------------------------- lighthouse
def serve_lighthouse(addr_file: Path, opts: dict[str, int]) -> None:
    """The lighthouse process: a torchft LighthouseServer on a free port (bind port 0); its address goes to
    `addr_file` (atomically). Runs until SIGTERM/SIGKILL or until its parent (the benchmark) is gone."""
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", **opts)
    tmp = addr_file.with_suffix(".tmp")
    tmp.write_text(lh.address())
    os.replace(tmp, addr_file)
    parent = os.getppid()
    try:
        while os.getppid() == parent:
            time.sleep(0.5)
    finally:
        lh.shutdown()


class Lighthouse:
    def __init__(self, work: Path, opts: dict[str, int]) -> None:
        addr_file = work / "lighthouse.addr"
        argv = [C.PY, str(Path(__file__).resolve()), "--serve-lighthouse", str(addr_file),
                "--lighthouse-opts", json.dumps(opts)]
        self.group = C.ProcGroup(argv, work / "lighthouse.log", C.env(threads=1))

        def addr() -> str | None:
            if not self.group.alive:
                raise RuntimeError(f"the lighthouse exited ({self.group.popen.returncode}):\n{self.group.tail()}")
            return addr_file.read_text().strip() if addr_file.exists() else None
        self.address: str = C.poll(addr, 120, "the lighthouse address", interval=0.05)


# ---------------------------------------------------------------------------------------- replicas
class Replica:
    """One incarnation of a replica group: a bench/torchft_train.py process in its own process group."""

    def __init__(self, work: Path, rid: int, inc: int, lighthouse: str, grad_sync: str) -> None:
        self.rid, self.inc = rid, inc
        self.log = work / f"r{rid}-{inc}.jsonl"
        argv = [C.PY, str(TRAIN), "--replica-id", str(rid), "--num-replicas", "2", "--lighthouse", lighthouse,
                "--log", str(self.log), "--workload", WL, "--grad-sync", grad_sync]
        self.t_spawn = time.time()
        self.group = C.ProcGroup(argv, work / f"r{rid}-{inc}.log", C.env(threads=1))
        self.tail = C.JsonlTail(self.log)

    @property
    def pid(self) -> int:
        return self.group.popen.pid

    def rows(self) -> list[dict[str, Any]]:
        return self.tail.read()

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.rows() if "event" not in r]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.rows() if r.get("event") == kind]

    def check_alive(self) -> None:
        if not self.group.alive:
            raise RuntimeError(f"replica {self.rid} (incarnation {self.inc}) exited "
                               f"({self.group.popen.returncode}):\n{self.group.tail(2500)}")

    def kill(self) -> float:
        """SIGKILL the whole process group; returns the time of the kill."""
        t = time.time()
        os.killpg(self.group.pgid, signal.SIGKILL)
        self.group.stop(grace=0)  # reap, wait until no process of the group is left
        return t


def steps_with_both(rep: Replica, after: float) -> int:
    return sum(1 for r in rep.steps() if r["t"] > after and r["participants"] == 2)


# ---------------------------------------------------------------------------------------- the benchmark
def torchft_kills(work: Path, kills: int, warmup_steps: int = 30, rejoin_steps: int = 20,
                  rejoin_timeout: float = 120.0, grad_sync: str = "manual",
                  lighthouse_opts: dict[str, int] | None = None) -> dict[str, Any]:
    opts = dict(LIGHTHOUSE if lighthouse_opts is None else lighthouse_opts)
    lh = Lighthouse(work, opts)
    C.log(f"torchft lighthouse at {lh.address} {opts}")
    r0 = Replica(work, 0, 0, lh.address, grad_sync)
    r1 = Replica(work, 1, 0, lh.address, grad_sync)
    incarnations = [r1]
    kill_log: list[dict[str, Any]] = []
    error = None
    try:
        def warm() -> bool:
            r0.check_alive()
            r1.check_alive()
            return steps_with_both(r0, 0) >= warmup_steps and steps_with_both(r1, 0) >= warmup_steps
        C.poll(warm, 240, f"both replicas training {warmup_steps} steps together", interval=0.05)
        for i in range(kills):
            old = r1
            # both groups train together again for `rejoin_steps` steps before each kill
            since = kill_log[-1]["t_kill"] if kill_log else 0.0

            def together(old: Replica = old, since: float = since) -> bool:
                r0.check_alive()
                old.check_alive()
                return steps_with_both(r0, since) >= rejoin_steps and steps_with_both(old, since) >= rejoin_steps
            C.poll(together, 120, "both replicas training together", interval=0.02)
            t_kill = old.kill()
            r1 = Replica(work, 1, i + 1, lh.address, grad_sync)  # restarted at once, same replica id
            incarnations.append(r1)
            last = old.steps()
            C.log(f"torchft kill {i + 1}/{kills}: replica 1 pid {old.pid} at its step "
                  f"{last[-1]['step'] if last else None}; restarted as pid {r1.pid}")
            kill_log.append({"t_kill": t_kill, "old": old, "new": r1})

            def rejoined(new: Replica = r1) -> bool:
                r0.check_alive()
                new.check_alive()
                return bool(new.steps())
            try:
                C.poll(rejoined, rejoin_timeout, f"the restarted replica 1 committing a step (kill {i + 1})",
                       interval=0.01)
            except TimeoutError as exc:
                error = str(exc)
                break
            C.log(f"  replica 1 rejoined after {r1.steps()[0]['t'] - t_kill:.2f} s at step {r1.steps()[0]['step']}")
        if error is None:  # let the last incarnation train with the survivor for a while (the window's end)
            t_last = kill_log[-1]["t_kill"] if kill_log else 0.0
            C.poll(lambda: steps_with_both(r0, t_last) >= rejoin_steps and steps_with_both(r1, t_last) >= rejoin_steps
                   or not (r0.group.alive and r1.group.alive), 120, "training together after the last kill")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:3000]
    finally:
        final = {"r0_alive": r0.group.alive, "r1_alive": r1.group.alive}
        for g in (r0.group, r1.group, lh.group):
            g.stop(grace=2)
    survivor = r0.steps()
    not_committed0 = r0.events("not_committed")
    per_kill = [analyse_kill(k, survivor, not_committed0, kill_log[j + 1]["t_kill"] if j + 1 < len(kill_log) else None)
                for j, k in enumerate(kill_log)]
    two = [b["t"] - a["t"] for a, b in zip(survivor, survivor[1:], strict=False)
           if a["participants"] == 2 and b["participants"] == 2]
    seq = [r["step"] for r in survivor]
    recovered = [k for k in per_kill if k.get("rejoin_s") is not None]
    out: dict[str, Any] = {
        "kills": len(per_kill), "recovered": len(recovered), "grad_sync": grad_sync, "lighthouse": opts,
        "step_interval_median_s": C.rnd(C.median(two)),
        "step_interval_p90_s": C.rnd(C.quantile(two, 0.9)),
        "medians": C.rnd({
            "survivor_max_gap_s": C.median(k["survivor_max_gap_s"] for k in per_kill),
            "rejoin_s": C.median(k["rejoin_s"] for k in recovered),
            "killed_replica_steps_redone": C.median(k["killed_replica_steps_redone"] for k in recovered),
            "killed_replica_steps_skipped": C.median(k["killed_replica_steps_skipped"] for k in recovered),
            "steps_with_samples_missing": C.median(k["steps_with_samples_missing"] for k in recovered),
            "survivor_discarded_steps": C.median(k["survivor_discarded_steps"] for k in per_kill),
            "survivor_steps_alone": C.median(k["survivor_steps_alone"] for k in per_kill),
        }),
        "per_kill": C.rnd(per_kill),
        "survivor_steps": {
            "last_step": seq[-1] if seq else None, "lines": len(seq),
            "consecutive": seq == list(range(seq[0], seq[0] + len(seq))) if seq else None,
            "by_participants": {str(p): sum(1 for r in survivor if r["participants"] == p)
                                for p in sorted({r["participants"] for r in survivor})},
            "discarded_attempts": len(not_committed0),
        },
        "alive_at_end": final,
        "error": error,
    }
    if error:
        out["log_tails"] = {f"r{rep.rid}-{rep.inc}": rep.group.tail(1500) for rep in [r0, *incarnations][-3:]}
    return out


def analyse_kill(k: dict[str, Any], survivor: list[dict[str, Any]], not_committed: list[dict[str, Any]],
                 next_kill: float | None) -> dict[str, Any]:
    t_kill: float = k["t_kill"]
    old: Replica = k["old"]
    new: Replica = k["new"]
    old_steps, new_steps = old.steps(), new.steps()
    end = next_kill if next_kill is not None else float("inf")
    last_before = old_steps[-1]["step"] if old_steps else None
    res: dict[str, Any] = {"killed_replica_last_step": last_before}
    start = next((r for r in new.events("start")), None)
    ready = next((r for r in new.events("ready")), None)
    res["restart_spawned_s"] = new.t_spawn - t_kill
    res["restart_python_started_s"] = start["t_proc"] - t_kill if start else None
    res["restart_manager_ready_s"] = ready["t"] - t_kill if ready else None
    first_new = new_steps[0] if new_steps else None
    # the survivor's steps from its last step before the kill to its first step with both groups again
    before = [r for r in survivor if r["t"] <= t_kill]
    both_again = next((r for r in survivor if r["t"] > t_kill and r["participants"] == 2
                       and (first_new is None or r["t"] >= first_new["t"])), None)
    t_end = both_again["t"] if both_again else min(end, t_kill + 60)
    window = ([before[-1]] if before else []) + [r for r in survivor if t_kill < r["t"] <= t_end]
    gaps = [b["t"] - a["t"] for a, b in zip(window, window[1:], strict=False)]
    res["survivor_step_at_kill"] = before[-1]["step"] if before else None
    res["survivor_max_gap_s"] = max(gaps) if gaps else None
    after = [r for r in survivor if r["t"] > t_kill]
    res["survivor_first_step_after_kill_s"] = after[0]["t"] - t_kill if after else None
    # steps the survivor committed on its own (1 participant), before the restarted replica's first (healing)
    # step; a step committed just after the kill with 2 participants was complete before the kill
    first_joint = first_new["step"] if first_new else None
    res["survivor_steps_alone"] = sum(1 for r in survivor if t_kill < r["t"] <= t_end and r["participants"] == 1
                                      and (first_joint is None or r["step"] < first_joint))
    res["survivor_kept_stepping"] = res["survivor_steps_alone"] > 0
    res["survivor_discarded_steps"] = sum(1 for r in not_committed if t_kill <= r["t"] <= t_end)
    if first_new is None:
        res["rejoin_s"] = None
        return res
    res["rejoin_s"] = first_new["t"] - t_kill
    res["killed_replica_first_step_after_restart"] = first_new["step"]
    res["killed_replica_first_step_participants"] = first_new["participants"]
    if last_before is not None:
        # the restarted replica's first committed step is `first`; it healed to state first-1
        res["killed_replica_steps_redone"] = max(0, last_before - (first_new["step"] - 1))
        res["killed_replica_steps_skipped"] = max(0, first_new["step"] - 1 - last_before)
    res["steps_with_samples_missing"] = sum(1 for r in survivor if t_kill < r["t"] <= t_end and r["participants"] == 1)
    res["survivor_back_to_2_participants_s"] = both_again["t"] - t_kill if both_again else None
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--kills", type=int, default=None, help="kills per lighthouse configuration")
    p.add_argument("--grad-sync", choices=("manual", "ddp"), default="manual",
                   help="see bench/torchft_train.py (ddp: torchft.DistributedDataParallel)")
    p.add_argument("--heartbeat-timeouts-ms", default="5000,1000",
                   help="lighthouse heartbeat_timeout_ms values, one run each (5000: torchft's default)")
    p.add_argument("--join-timeout-ms", type=int, default=LIGHTHOUSE["join_timeout_ms"])
    p.add_argument("--keep", action="store_true")
    p.add_argument("--serve-lighthouse", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse-opts", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_lighthouse:
        serve_lighthouse(Path(args.serve_lighthouse), json.loads(args.lighthouse_opts))
        return

    try:
        import importlib.metadata

        import torchft  # noqa: F401

        version = importlib.metadata.version("torchft")
    except Exception as exc:  # not installed, or broken against this torch
        print(json.dumps({"bench": "torchft_recovery", **C.provenance(), "skipped": f"torchft cannot be imported: "
                          f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
        return

    C.setup(threads=1)
    kills = args.kills if args.kills is not None else (3 if args.quick else 5)
    hbs = [int(x) for x in args.heartbeat_timeouts_ms.split(",") if x.strip()]
    work = C.workdir("torchft-recovery")
    result: dict[str, Any] = {"bench": "torchft_recovery", **C.provenance(), "machine": C.machine(), "quick": args.quick,
                              "torchft": version, "workload": WORKLOADS[WL], "torchft_kills": {}}
    t_start = time.monotonic()
    try:
        summary: dict[str, Any] = {}
        errors = []
        for hb in hbs:
            key = f"heartbeat_timeout_ms={hb}"
            opts = dict(LIGHTHOUSE, heartbeat_timeout_ms=hb, join_timeout_ms=args.join_timeout_ms)
            d = work / key.replace("=", "-")
            d.mkdir()
            C.log(f"torchft ({key}): {kills} kills of replica 1 (2 replica groups)")
            r = result["torchft_kills"][key] = torchft_kills(d, kills, grad_sync=args.grad_sync, lighthouse_opts=opts)
            m = r["medians"]
            summary[f"torchft[{key}]"] = {
                "recovered": f"{r['recovered']}/{r['kills']}",
                "rejoin_s_median": m["rejoin_s"],
                "survivor_max_gap_s_median": m["survivor_max_gap_s"],
                "survivor_kept_stepping": [k.get("survivor_kept_stepping") for k in r["per_kill"]],
                "survivor_steps_alone_median": m["survivor_steps_alone"],
                "killed_replica_steps_redone_median": m["killed_replica_steps_redone"],
                "killed_replica_steps_skipped_median": m["killed_replica_steps_skipped"],
                "steps_with_samples_missing_median": m["steps_with_samples_missing"],
                "step_interval_median_s": r["step_interval_median_s"],
            }
            if r.get("error"):
                errors.append(f"{key}: {r['error']}")
        result["summary"] = summary
        if errors:
            result["error"] = " | ".join(errors)[:3000]
        result["notes"] = NOTES
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        C.finish(result, work, args.keep, t_start)


NOTES = [
    "times are seconds from the SIGKILL of replica 1 (wall clock); 2 shared cores, so starting the replacement "
    "process (importing torch, about 2.5 s to 'manager ready') is a large part of the rejoin time",
    "lighthouse: min_replicas 1, quorum_tick_ms 100, join_timeout_ms 10000 (torchft's README); a quorum without "
    "the dead replica needs its heartbeat to time out (heartbeat_timeout_ms; 5000 is torchft's default): with 2 "
    "replica groups, the split-brain rule (participants must be more than half of the heartbeating replicas) and "
    "the wait for heartbeating stragglers keep the survivor waiting until then, even once the restarted replica "
    "has asked to join",
    "torchft semantics: once that quorum forms, the surviving replica group trains on its own; each such step "
    "commits with num_participants() == 1, i.e. with only the survivor's half of the global batch (averaged over 1 "
    "instead of 2): the dead replica's samples of those steps are never trained (steps_with_samples_missing; it "
    "includes the restarted replica's first step, whose gradient is zeroed while it heals)",
    "the step in flight at the kill fails in the survivor's allreduce (gloo: connection closed by peer) and is "
    "discarded by should_commit and redone (survivor_discarded_steps); the global step never goes back",
    "the restarted replica heals from the survivor (model + optimizer state over HTTP, the Manager's default "
    "checkpoint transport) and resumes at the survivor's current step: it redoes nothing and skips the steps "
    "trained without it (killed_replica_steps_skipped = survivor_steps_alone)",
    "survivor_steps counts the whole run of replica 0, including its start, where whichever replica asked the "
    "lighthouse first trains alone for a few steps until the other has joined and healed from it",
    "gradients are synchronised with manager.allreduce on one flat buffer (grad_sync manual): "
    "torchft.DistributedDataParallel (0.2.0) crashes the surviving replica with an AssertionError in its comm "
    "hook when a peer dies (see bench/torchft_train.py)",
]


if __name__ == "__main__":
    main()
