"""Recovery from faults: CMEMI worker kills, CMEMI aggregator kills, and torchrun elastic restarts.

1. Workers: one `cmemi up` run (2 workers, 1 warm spare); SIGKILL a worker N times (alternating w0/w1),
   each time after the warm spare is ready again (a spare is ready when it blocks in BLPOP on its Redis
   list) and the previous replacement has contributed. Timelines from RUN_DIR/events.jsonl through
   cmemi.commands.events.timelines (detect_s, reassign_s, joined_s, first_grad_s); metrics.jsonl must hold each
   step exactly once (steps_lost = steps_redone = 0).
2. Aggregator: a separate run with checkpoint.every_steps = E; SIGKILL the process whose Redis member
   record has role aggregator, M times, at spread-out phases of the checkpoint interval. Recovery time =
   kill -> the first step completed by the restarted aggregator; steps redone = last step before the
   kill - the step restored from the checkpoint.
3. torchrun: `python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 3` on a DDP
   script (bench/torch_train.py) that checkpoints every E steps; SIGKILL rank 1 K times; recovery time =
   kill -> the first step of the restarted group; steps redone likewise. Run with and without
   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch 2.13's c10d rendezvous often fails to re-form without it).

4. The step log (`--parts steplog`, bench/recovery_log.py): leader SIGKILLs at K = 1 and 2 and shard SIGKILLs at
   K = 2, each run with and without `checkpoint.step_log` on the same config: steps redone, seconds from the kill
   to the next new step, and the step-time overhead of the log.

    .venv/bin/python bench/recovery.py [--quick] [--worker-kills N] [--aggregator-kills M] [--torchrun-kills K]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench import recovery_log  # noqa: E402
from bench.models import WORKLOADS  # noqa: E402

WL = "small"
SCRIPT = C.ROOT / "bench" / "torch_train.py"
BIG = 10_000_000  # training "forever": the benchmark stops the run once its faults are measured


def stream_events(run: C.CmemiRun, kind: str) -> list[dict[str, Any]]:
    evs = [json.loads(f["json"]) for _id, f in run.redis.xrange(run.keys.events)]
    return [e for e in evs if e["kind"] == kind]


def steps_check(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [m["step"] for m in metrics]
    if not steps:
        return {"steps": 0}
    last = max(steps)
    seen = set(steps)
    return {"last_step": last, "lines": len(steps), "steps_lost": len(set(range(1, last + 1)) - seen),
            "steps_redone": len(steps) - len(seen), "exactly_once": steps == list(range(1, last + 1))}


# ---------------------------------------------------------------------------------------- 1. workers
def worker_kills(work: Path, kills: int, spacing: float) -> dict[str, Any]:
    cfg = C.cmemi_config("rec_workers", work / "rec_workers", WORKLOADS[WL], steps=BIG, microbatches=4, workers=2,
                         spares=1)
    kill_log = []
    with C.CmemiRun(cfg, work) as run:
        run.wait_step(20, timeout=180)
        for i in range(kills):
            target = f"w{i % 2}"
            C.poll(lambda: run.ready_spares() >= 1, 120, "a warm spare ready")
            old_inc = int(run.member("worker", target)["incarnation"])
            step_before = run.step()
            pid, t_kill = run.kill("worker", target)
            C.log(f"worker kill {i + 1}/{kills}: {target} pid {pid} at step {step_before}")

            def replaced(target: str = target, old_inc: int = old_inc) -> bool:
                return any(e.get("worker") == target and e.get("incarnation", 0) > old_inc
                           for e in stream_events(run, "first_grad_accepted"))
            C.poll(replaced, 120, f"the replacement of {target} contributing", interval=0.05)
            kill_log.append({"worker": target, "pid": pid, "t": t_kill, "step": step_before})
            time.sleep(spacing)
        time.sleep(1.0)
        run.terminate()  # graceful stop (cmemi up: SIGTERM), so events.jsonl is complete
        events, metrics = run.events(), run.metrics()
    from cmemi.commands.events import timelines

    rows = [r for r in timelines(events) if r["role"] == "worker"]
    cols = ("detect_s", "reassign_s", "joined_s", "first_grad_s")
    med = {c: C.median(r.get(c) for r in rows) for c in cols}
    # the stall a kill causes: the longest step around each kill vs the median step
    base = C.median(m["step_time_s"] for m in metrics[10:] if "step_time_s" in m) if len(metrics) > 10 else None
    stalls = []
    for i, k in enumerate(kill_log):
        end = kill_log[i + 1]["t"] if i + 1 < len(kill_log) else k["t"] + 5
        around = [m["step_time_s"] for m in metrics if k["t"] <= m["t"] <= min(end, k["t"] + 5)]
        stalls.append(max(around) if around else None)
    return {
        "kills": len(kill_log), "timeline_median_s": C.rnd(med), "timelines": C.rnd(rows),
        "step_time_median_s": C.rnd(base), "max_step_time_after_kill_s": C.rnd(stalls),
        "max_step_time_after_kill_median_s": C.rnd(C.median(stalls)),
        "steps": steps_check(metrics), "restarts_via": [e.get("via") for e in events if e["kind"] == "restarted"],
    }


# ---------------------------------------------------------------------------------------- 2. aggregator
def aggregator_kills(work: Path, kills: int, every: int) -> dict[str, Any]:
    cfg = C.cmemi_config("rec_aggregator", work / "rec_aggregator", WORKLOADS[WL], steps=BIG, microbatches=4,
                         workers=2, spares=0, ckpt_every=every, keep_last=2)
    out = []
    with C.CmemiRun(cfg, work) as run:
        k = run.keys
        for i in range(kills):
            phase = int(every * (i + 0.5) / kills)  # spread the kill over the checkpoint interval
            latest = int(run.redis.get(k.ckpt_latest) or 0)

            def at_phase(latest: int = latest, phase: int = phase) -> int:
                s = run.step()
                return s if s > latest + every and s % every == phase else 0
            C.poll(at_phase, 240, f"step at phase {phase} of the checkpoint interval", interval=0.002)
            term = int(run.redis.hget(k.aggregator, "term") or 0)
            restored_expected = int(run.redis.get(k.ckpt_latest) or 0)
            pid, t_kill = run.kill("aggregator", "0")
            step_at_kill = run.step()
            C.log(f"aggregator kill {i + 1}/{kills}: pid {pid} at step {step_at_kill} (latest checkpoint "
                  f"{restored_expected})")

            def advanced(term: int = term, t_kill: float = t_kill) -> bool:
                p = run.redis.hgetall(k.progress)
                return int(p.get("term", 0)) > term and float(p.get("t", 0)) > t_kill
            C.poll(advanced, 180, "the restarted aggregator completing a step", interval=0.01)
            out.append({"pid": pid, "t": t_kill, "term": term})
        time.sleep(1.0)
        run.terminate()
        events, metrics = run.events(), run.metrics()
    from cmemi.commands.events import timelines

    rows = {round(r["killed_at"], 3): r for r in timelines(events) if r["role"] == "aggregator"}
    res = []
    for o in out:
        before = [m for m in metrics if m["t"] < o["t"]]
        after = [m for m in metrics if m["t"] > o["t"]]
        last_before = before[-1]["step"] if before else 0
        first_after = after[0] if after else None
        row = next((r for t, r in rows.items() if abs(t - o["t"]) < 1.0), {})
        restarted = [e for e in events if e["kind"] == "aggregator_started" and e["t"] > o["t"]]
        res.append({
            "last_step_before_kill": last_before,
            "restored_step": first_after["step"] - 1 if first_after else None,
            "steps_redone": last_before - (first_after["step"] - 1) if first_after else None,
            "detect_s": row.get("detect_s"), "restarted_s": row.get("restarted_s"),
            "restored_from_step": restarted[0].get("step") if restarted else None,
            "recovery_s": first_after["t"] - o["t"] if first_after else None,
        })
    step_med = C.median(m["step_time_s"] for m in metrics if m["step"] > 5)
    return {
        "kills": len(res), "checkpoint_every_steps": every,
        "recovery_s_median": C.rnd(C.median(r["recovery_s"] for r in res)),
        "steps_redone_median": C.median(r["steps_redone"] for r in res),
        "steps_redone_expected_mean": (every - 1) / 2,
        "step_time_median_s": C.rnd(step_med),
        "per_kill": C.rnd(res),
        "restart_backoff_note": "the coordinator's restart backoff is 0 s for a process's 1st restart, then 0.5 s "
                                "doubling, counted over the whole run (it does not reset after healthy periods)",
        "steps_in_metrics": steps_check(metrics),
    }


# ---------------------------------------------------------------------------------------- 3. torchrun
def torchrun_kills(work: Path, kills: int, every: int, share_store: bool, timeout: float) -> dict[str, Any]:
    tag = "shared_store" if share_store else "no_shared_store"
    d = work / f"torchrun-{tag}"
    d.mkdir()
    ev = d / "events.jsonl"
    extra = {} if share_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    argv = [C.PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "3",
            "--monitor-interval", "0.1", str(SCRIPT), "--workload", WL, "--steps", str(BIG), "--ckpt-dir", str(d),
            "--ckpt-every", str(every), "--events", str(ev)]
    group = C.ProcGroup(argv, d / "torchrun.log", C.env(**extra))

    tail = C.JsonlTail(ev)
    last: dict[int, int] = {}

    def records() -> list[dict[str, Any]]:
        n = len(tail.rows)
        rows = tail.read()
        for r in rows[n:]:
            if r["kind"] == "step":
                last[r["restart"]] = max(last.get(r["restart"], 0), r["step"])
        return rows

    def last_step(restart: int) -> int:
        records()
        return last.get(restart, 0)

    res: list[dict[str, Any]] = []
    error = None
    try:
        restart = 0
        C.poll(lambda: group.alive and last_step(0) >= 25 or not group.alive, 180, "torchrun training")
        if not group.alive:
            raise RuntimeError(f"torchrun exited early:\n{group.tail()}")
        for i in range(kills):
            phase = int(every * (i + 0.5) / kills)
            base = last_step(restart)
            C.poll(lambda restart=restart, base=base, phase=phase:
                   (s := last_step(restart)) > base + every and s % every == phase or not group.alive,
                   120, "step at phase", interval=0.002)
            starts = [r for r in records() if r["kind"] == "start" and r["restart"] == restart and r["rank"] == 1]
            if not starts or not group.alive:
                raise RuntimeError(f"torchrun not running as expected:\n{group.tail()}")
            pid = starts[-1]["pid"]
            t_kill = time.time()
            import os

            os.kill(pid, signal.SIGKILL)
            C.log(f"torchrun ({tag}) kill {i + 1}/{kills}: rank 1 pid {pid} near step {last_step(restart)}")

            def resumed(restart: int = restart) -> bool:
                records()
                return any(k > restart for k in last) or not group.alive
            try:
                C.poll(resumed, timeout, "torchrun stepping again", interval=0.02)
            except TimeoutError:
                res.append({"recovered": False, "waited_s": timeout})
                error = f"no step within {timeout:g}s of kill {i + 1}"
                break
            recs = records()
            new = [r for r in recs if r["kind"] == "step" and r["restart"] > restart]
            if not new:
                res.append({"recovered": False, "torchrun_exit": group.popen.poll()})
                error = f"torchrun exited after kill {i + 1} (rc {group.popen.poll()})"
                break
            new_restart = new[0]["restart"]
            before = [r["step"] for r in recs if r["kind"] == "step" and r["restart"] == restart and r["t"] <= t_kill]
            resumed_from = next((r["from_step"] for r in recs if r["kind"] == "resumed" and r["restart"] == new_restart),
                                None)
            first_start = min((r["t_proc"] for r in recs if r["kind"] == "start" and r["restart"] == new_restart),
                              default=None)
            res.append({"recovered": True, "restart": new_restart, "last_step_before_kill": max(before, default=0),
                        "restored_step": resumed_from,
                        "steps_redone": max(before, default=0) - resumed_from if resumed_from is not None else None,
                        "new_processes_started_s": first_start - t_kill if first_start else None,
                        "recovery_s": new[0]["t"] - t_kill})
            restart = new_restart
        if group.alive:
            group.stop(grace=5)
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise
        error = f"{type(exc).__name__}: {exc}"[:600]
    finally:
        group.stop(grace=2)
    ok = [r for r in res if r.get("recovered")]
    log_tail = (d / "torchrun.log").read_text(errors="replace")[-1500:] if error else None
    return {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": None if share_store else "1",
        "kills_attempted": len(res), "recovered": len(ok),
        "recovery_s_median": C.rnd(C.median(r["recovery_s"] for r in ok)),
        "steps_redone_median": C.median(r["steps_redone"] for r in ok),
        "per_kill": C.rnd(res), "error": error, "log_tail": log_tail,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker-kills", type=int, default=None)
    p.add_argument("--aggregator-kills", type=int, default=None)
    p.add_argument("--torchrun-kills", type=int, default=None)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--spacing", type=float, default=1.0, help="extra seconds between worker kills")
    p.add_argument("--torchrun-timeout", type=float, default=None, help="seconds to wait for a torchrun restart")
    p.add_argument("--parts", default="workers,aggregator,torchrun")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    C.setup(threads=1)
    wk = args.worker_kills if args.worker_kills is not None else (3 if args.quick else 5)
    ak = args.aggregator_kills if args.aggregator_kills is not None else (2 if args.quick else 3)
    tk = args.torchrun_kills if args.torchrun_kills is not None else (2 if args.quick else 3)
    tt = args.torchrun_timeout or (30 if args.quick else 90)
    parts = args.parts.split(",")
    work = C.workdir("recovery")
    result: dict[str, Any] = {"bench": "recovery", **C.provenance(), "machine": C.machine(), "quick": args.quick, "workload": WORKLOADS[WL]}
    t_start = time.monotonic()
    try:
        if "workers" in parts:
            C.log(f"CMEMI: {wk} worker kills")
            result["cmemi_worker_kills"] = worker_kills(work, wk, args.spacing)
        if "aggregator" in parts:
            C.log(f"CMEMI: {ak} aggregator kills")
            result["cmemi_aggregator_kills"] = aggregator_kills(work, ak, args.checkpoint_every)
        if "steplog" in parts:
            C.log(f"CMEMI: step log rows, checkpoint every {args.checkpoint_every}")
            result["cmemi_step_log"] = recovery_log.rows(work, args.checkpoint_every, 2 if args.quick else 3)
        if "torchrun" in parts:
            result["torchrun"] = {}
            for share in (True, False):
                C.log(f"torchrun --max-restarts 3: {tk} kills, shared rendezvous store {share}")
                key = "default" if share else "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
                result["torchrun"][key] = torchrun_kills(work, tk, args.checkpoint_every, share, tt)
        summary: dict[str, Any] = {}
        if "cmemi_worker_kills" in result:
            w = result["cmemi_worker_kills"]
            summary["cmemi_worker_first_grad_s_median"] = w["timeline_median_s"]["first_grad_s"]
            summary["cmemi_worker_steps_lost_redone"] = [w["steps"].get("steps_lost"), w["steps"].get("steps_redone")]
        if "cmemi_aggregator_kills" in result:
            a = result["cmemi_aggregator_kills"]
            summary["cmemi_aggregator_recovery_s_median"] = a["recovery_s_median"]
            summary["cmemi_aggregator_steps_redone_median"] = a["steps_redone_median"]
        for key, r in result.get("cmemi_step_log", {}).items():
            summary[f"step_log[{key}]_steps_redone_with_without"] = [r["with_log"]["steps_redone"],
                                                                       r["without_log"]["steps_redone"]]
            summary[f"step_log[{key}]_kill_to_next_new_step_s_with_without"] = [
                r["with_log"]["kill_to_next_new_step_s_median"], r["without_log"]["kill_to_next_new_step_s_median"]]
            summary[f"step_log[{key}]_step_time_overhead"] = r["step_time_overhead"]
        for key, t in result.get("torchrun", {}).items():
            summary[f"torchrun[{key}]_recovery_s_median"] = t["recovery_s_median"]
            summary[f"torchrun[{key}]_recovered"] = f"{t['recovered']}/{t['kills_attempted']}"
            summary[f"torchrun[{key}]_steps_redone_median"] = t["steps_redone_median"]
        result["summary"] = summary
        result["notes"] = [
            "times are seconds from the SIGKILL; 2 shared cores, so process start-up (importing torch) is slow and "
            "dominates every restart that needs a new process",
            "CMEMI worker kills: a warm spare (torch imported, data loaded) takes the dead worker's id; no step is "
            "redone; the dead worker's leases are freed at once and done by the surviving worker meanwhile",
            "CMEMI aggregator and torchrun restarts resume from the last checkpoint (every "
            f"{args.checkpoint_every} steps): redone steps are expected to average about half the interval",
            "torchrun restarts every process of the group for one dead rank (the agent stops the survivors)",
        ]
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        C.finish(result, work, args.keep, t_start)


if __name__ == "__main__":
    main()
