"""`cmemi up CONFIG`: the whole cluster on this machine — Redis (embedded unless configured), the
coordinator, and through it the aggregator, checkpointer and workers — with a progress line.

Exits 0 only when the run completed. Ctrl-C stops everything in stages, embedded Redis included.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, cast

import redis

from cmemi.launcher.prometheus_targets import TargetsFile
from cmemi.launcher.redis_server import EmbeddedRedis
from cmemi.launcher.run_security import child_env, secure_run
from cmemi.launcher.startup_report import StartupReport
from cmemi.launcher.supervise import (
    RunLock,
    Supervisor,
    become_subreaper,
    check_resume,
    clear_run_dir,
    refuse_live_run,
    run_supervised,
    stop_orphans,
)
from cmemi.launcher.teardown import stop_together
from cmemi.launcher.zygote_up import Zygote
from cmemi.services.aggregator.leader.trackers import registry as trackers
from cmemi.services.checkpointer.errors import DISK_FULL
from cmemi.services.coordinator.supervisor import service_argv
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import dump_config
from cmemi.shared.config.schema import Config
from cmemi.shared.coordination.keys import Keys
from cmemi.shared.coordination.membership import connect, text, wait_for_redis
from cmemi.shared.runtime import startup
from cmemi.shared.runtime.log import LOG_DIR_ENV


def prepare_run_dir(cfg: Config, resume: bool, overwrite: bool, force_config: bool = False,
                    lock: RunLock | None = None) -> tuple[Path, RunLock]:
    """`lock`: the run directory's lock when the caller took it already (a second RunLock in this process
    would be refused by the first)."""
    run_dir = cfg.run.path.resolve()
    lock = lock or RunLock(run_dir)  # before anything is read or deleted: one `cmemi up` per run directory
    used = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()) or any(
        (run_dir / n).exists() for n in ("summary.json", "metrics.jsonl"))
    if used and not (resume or overwrite):
        raise ConfigError(f"run directory {str(run_dir)!r} already holds a run; pass --resume to continue it, "
                          "--overwrite to start over, or choose another run.name / run.dir")
    if resume and not overwrite:
        check_resume(run_dir, cfg, force_config)
    if used and overwrite:
        clear_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run.dir = str(run_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "children.json").unlink(missing_ok=True)  # a new coordinator starts its services afresh
    (run_dir / "cluster.json").unlink(missing_ok=True)  # names the previous run's Redis until rewritten
    return run_dir, lock


def clear_run_keys(client: redis.Redis, keys: Keys) -> None:
    batch = list(client.scan_iter(match=keys.prefix + "*", count=1000))
    for i in range(0, len(batch), 500):
        client.delete(*batch[i:i + 500])


class Progress:
    """One line: a bar on a terminal, a periodic log line otherwise."""

    def __init__(self, total: int, local_steps: int = 0) -> None:
        self.total = total
        self.H = local_steps  # train.local_steps: a step of the servers is a round of H inner steps
        self.tty = sys.stdout.isatty()
        self.last_print = 0.0
        self.last_step = -1

    def show(self, p: dict[str, Any]) -> None:
        step = int(p.get("step", 0))
        now = time.monotonic()
        if not self.tty and (step == self.last_step or (now - self.last_print < 5 and step < self.total)):
            return
        self.last_step, self.last_print = step, now
        width = 24
        filled = int(width * step / max(1, self.total))
        where = (f"round {step:>4}/{self.total} (inner step {step * self.H}/{self.total * self.H})" if self.H
                 else f"step {step:>6}/{self.total}")
        line = (f"{where} [{'#' * filled}{'.' * (width - filled)}] "
                f"loss {p.get('loss', '-'):>9}  lr {p.get('lr', '-'):>8}  {p.get('samples_s', '-'):>8} samples/s  "
                f"workers {p.get('live_workers', '-')}")
        if self.tty:
            print("\r" + line, end="", flush=True)
        else:
            print(line, flush=True)

    def end(self) -> None:
        if self.tty:
            print()


def up(cfg: Config, resume: bool = False, overwrite: bool = False, force_config: bool = False,
       verbose: bool = False, lock: RunLock | None = None, zygote: Zygote | None = None) -> int:
    trackers.check(cfg)  # a tracker's missing package is one line now, not the leader's failure after start-up
    run_dir, lock = prepare_run_dir(cfg, resume, overwrite, force_config, lock)
    secure_run(cfg, run_dir)
    if zygote is not None:
        zygote.serve(run_dir)  # it checks the config's functions, then forks the services (cmemi/launcher/zygote.py)
    become_subreaper()
    os.environ["CMEMI_UP_PID"] = str(os.getpid())  # services die with `cmemi up` (shared/runtime/lifeline.py)
    os.environ["CMEMI_UP"] = "1"  # services leave the run's error line to `cmemi up`
    keys = Keys(cfg.run.name)
    embedded = None
    if cfg.cluster.redis is None:
        embedded = EmbeddedRedis(run_dir / "redis").start()
        startup.mark("redis_started")
        url = embedded.url
    else:
        url = cfg.cluster.redis
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sup: Supervisor | None = None
    try:
        client = connect(url)
        wait_for_redis(client, timeout=30)
        startup.mark("redis_ready")
        refuse_live_run(client, keys)
        clear_run_keys(client, keys)
        tmp = run_dir / "cluster.json.tmp"  # written whole, then renamed: readers never see half a file
        tmp.write_text(json.dumps({"redis": url, "run": cfg.run.name}))
        tmp.chmod(0o600)
        os.replace(tmp, run_dir / "cluster.json")
        os.environ.setdefault(LOG_DIR_ENV, str(run_dir / "logs"))  # every service inherits where its log goes
        sup = Supervisor(service_argv("coordinator", str(run_dir / "config.yaml"), "--supervise", "local"),
                         embedded, client, keys, cfg.cluster.max_restarts, env=child_env(url))
        if zygote is not None:
            sup.others.append(zygote.proc)
        print(f"cmemi: run {cfg.run.name!r} in {run_dir} with {cfg.cluster.workers} workers "
              f"(redis {'embedded' if embedded else url.split('@')[-1]}, "
              f"{'CurveZMQ on' if cfg.security.curve else 'CurveZMQ OFF (security.curve: false)'}; "
              f"service logs: cmemi logs {run_dir})", flush=True)
        progress = Progress(cfg.train.rounds, cfg.train.segment if cfg.train.local_steps else 0)
        scrape = TargetsFile(run_dir, client, keys, cfg.run.name) if cfg.metrics.enabled else None
        report: StartupReport | None = None

        def show_startup() -> None:
            if verbose:
                progress.end()
                print(report.format() if report is not None else "cmemi: start-up: no timeline", flush=True)

        checked = zygote is None

        def show() -> None:
            nonlocal report, checked
            if report is None:  # the coordinator has just been spawned: every phase of `cmemi up` is known
                report = StartupReport(run_dir, client, keys, cfg.cluster.workers, startup.phases())
            try:
                verdict = zygote.poll() if not checked and zygote is not None else None
                if verdict is not None:
                    checked = True
                    if verdict.get("rc") is None:  # the zygote died before it could check: check here
                        from cmemi.shared.config.plugins import check_plugins

                        check_plugins(cfg)
                        startup.mark("plugins_checked")
                    else:
                        report.processes["zygote"] = verdict["phases"]
                        report.cpu_s["zygote"] = verdict.get("cpu_s")
            except ConfigError:  # exit 2, one line; no service ran, so nothing may point at this Redis
                (run_dir / "cluster.json").unlink(missing_ok=True)
                raise
            if report.poll():
                show_startup()
            if scrape is not None:  # where Prometheus scrapes, as services come and go (every 0.25 s)
                scrape.refresh()
            try:
                progress.show(cast("dict[str, Any]", client.hgetall(keys.progress)))  # decoded (`text`)
            except redis.RedisError:
                pass

        try:
            ended = run_supervised(sup, lambda: stopping, show)
        except RuntimeError as exc:  # the coordinator or redis-server keeps dying
            progress.end()
            print(f"cmemi: error: {exc}", file=sys.stderr)
            return 1
        if report is not None and not report.done and not report.poll():  # a run that ended before all reported
            report.write()
            show_startup()
        if ended is None:
            print("\ncmemi: stopping (Ctrl-C again is not needed; waiting up to 10 s)", flush=True)
            sup.stop()
        progress.end()
        rc = sup.coordinator.wait() if sup.coordinator is not None else 1
        state = error = user_error = None
        try:
            state, error, user_error = (text(client.get(keys.state)), text(client.get(keys.error)),
                                        text(client.get(keys.user_error)))
        except redis.RedisError:
            pass
        if rc == 0 and state == "completed":
            summary = json.loads((run_dir / "summary.json").read_text())
            print(f"cmemi: completed {summary['steps']} {'rounds' if cfg.train.local_steps else 'steps'} in {summary['wall_s']:.1f}s "
                  f"({summary['samples_per_s'] or 0:.0f} samples/s), final loss "
                  f"{summary['final_loss']:.4f}, eval {summary['eval']}; summary: {run_dir / 'summary.json'}")
            return 0
        if stopping:
            print("cmemi: stopped before the run completed; continue it with --resume", file=sys.stderr)
            return 130
        print(f"cmemi: error: {error or f'the run did not complete (coordinator exit code {rc})'} "
              f"(service logs: cmemi logs {run_dir})", file=sys.stderr)
        # 2: user-fixable (config, data, user code, a full disk: resumable once there is room); restarting won't help
        return 2 if user_error or (error and error.startswith(DISK_FULL)) else 1
    finally:
        if sup is not None:
            sup.stop(grace=0)
        stop_orphans(run_dir)
        held = {"zygote": zygote.proc if zygote is not None else None,
                "redis-server": embedded.proc if embedded is not None else None}
        stop_together({name: p for name, p in held.items() if p is not None})  # at once, not one after another
        for s, h in old.items():
            signal.signal(s, h)
        os.environ.pop("CMEMI_UP_PID", None)
        os.environ.pop("CMEMI_UP", None)
        lock.release()
