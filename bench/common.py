"""Shared helpers of the benchmark scripts: pinned environments, process groups that are always cleaned
up, a `cmemi up` runner with access to its Redis, and small statistics.

Every process a benchmark starts is started in its own session (its own process group) and killed
as a group on every path (normal end, exception, SIGTERM/SIGINT/SIGHUP of the benchmark itself).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS")

_T0 = time.monotonic()
_GROUPS: list[ProcGroup] = []


def log(*parts: Any) -> None:
    """Progress goes to stderr; stdout carries only the final JSON object."""
    print(f"[{time.monotonic() - _T0:7.1f}s]", *parts, file=sys.stderr, flush=True)


def pin_threads(n: int = 1) -> None:
    """Pin this process (and children started with `env()`) to n intra-op threads."""
    for v in THREAD_VARS:
        os.environ[v] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # already set (interop threads can be set once)
        pass


def env(threads: int = 1, **extra: str) -> dict[str, str]:
    e = dict(os.environ)
    for v in THREAD_VARS:
        e[v] = str(threads)
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["PYTHONUNBUFFERED"] = "1"
    e.update(extra)
    return e


def _on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def setup(threads: int = 1) -> None:
    """Call first in main(): pinned threads, and signals that unwind through `finally` blocks."""
    pin_threads(threads)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, _on_signal)
    os.chdir(ROOT)


def emit_result(obj: dict[str, Any]) -> None:
    """Print a script's JSON object, with its provenance (taken at its start; here if it was not) and the load at
    its end."""
    now = provenance()
    if "commit" not in obj:
        obj.update(now)
    elif now["commit"] != obj["commit"] or now["dirty"] != obj["dirty"]:
        obj["commit_note"] = (f"the tree changed while it ran: at the end, commit {now['commit']}, dirty "
                              f"{now['dirty']}")
    m = obj.get("machine")
    if isinstance(m, dict):
        m["loadavg_at_end"] = load_avg()
        busy = max(m.get("loadavg_at_start", [0])[0], m["loadavg_at_end"][0])
        if busy > 1.5 * (m.get("cpus") or 1):
            m["warning"] = (f"the machine was overloaded (1-min load average up to {busy:g} on {m.get('cpus')} cores): "
                            "absolute times are inflated and ratios noisy")
    print(json.dumps(obj, indent=1, default=jsonable), flush=True)


def jsonable(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(type(o).__name__)


# ---------------------------------------------------------------------------------------- processes
def _term_with_parent() -> None:  # in the child, between fork and exec
    """SIGTERM the group leader if the benchmark dies (even by SIGKILL): it then stops its own children."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ProcGroup:
    """A subprocess in its own session; `stop()` SIGTERMs it, then SIGKILLs its whole process group."""

    def __init__(self, argv: list[str], log_path: Path | None = None, env_: dict[str, str] | None = None,
                 cwd: Path = ROOT) -> None:
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env_ or env(), stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_term_with_parent)
        self.pgid = self.popen.pid
        _GROUPS.append(self)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the leader (graceful), then SIGKILL the whole group (stragglers included)."""
        if self.alive:
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.wait(grace)
        self.kill_group()
        rc = self.popen.poll()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        if self in _GROUPS:
            _GROUPS.remove(self)
        return rc

    def kill_group(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # wait until no process of the group is left (killed children are reaped by init)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and group_alive(self.pgid):
            time.sleep(0.05)

    def tail(self, n: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # zombies still count for killpg(0); look at /proc for live members
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_all_groups() -> None:
    for g in list(_GROUPS):
        g.stop(grace=5)


def run_checked(argv: list[str], timeout: float, log_path: Path, env_: dict[str, str] | None = None) -> int:
    """Run to completion in its own process group (killed on timeout or on any exception)."""
    g = ProcGroup(argv, log_path, env_)
    try:
        rc = g.wait(timeout)
        if rc is None:
            raise TimeoutError(f"{' '.join(argv[:6])}... did not finish within {timeout:g}s; log {log_path}")
        return rc
    finally:
        g.stop(grace=2)


def poll(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout:g}s")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (bytes) of a process; empty if it is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def minor_faults(pid: int) -> int | None:
    """Minor page faults of a process so far (/proc/PID/stat minflt): fresh memory being touched."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return None


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def group_pids(pgid: int) -> dict[int, str]:
    """Live processes of a process group -> a short label from their command line."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        out[int(p.name)] = label(argv)
    return out


def label(argv: list[bytes]) -> str:
    a = [x.decode(errors="replace") for x in argv if x]
    if any("redis-server" in x for x in a[:1]):
        return "redis"
    if "cmemi" in a:
        i = a.index("cmemi")
        role = a[i + 1] if i + 1 < len(a) else "?"
        if role == "worker":
            if "--spare" in a:
                return "spare"
            return "worker:" + (a[a.index("--worker-id") + 1] if "--worker-id" in a else "?")
        return role
    return Path(a[0]).name if a else "?"


class GroupCpu:
    """CPU seconds used by every process of a process group between two samples (and progress between them).

    `sample(progress)` once the measured phase starts and then periodically; `per_unit()` gives CPU seconds
    per unit of progress (e.g. per training step), by role and in total.
    """

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.labels: dict[int, str] = {}
        self.p0 = self.p1 = None
        self.t0 = self.t1 = None

    def sample(self, progress: float) -> None:
        now = time.monotonic()
        for pid, lab in group_pids(self.pgid).items():
            cpu = cpu_seconds(pid)
            if cpu is None:
                continue
            if pid not in self.first:
                self.first[pid] = cpu if self.p0 is not None else cpu
                self.labels[pid] = lab
            self.last[pid] = cpu
        if self.p0 is None:
            self.p0, self.t0 = progress, now
        self.p1, self.t1 = progress, now

    def per_unit(self) -> dict[str, Any]:
        if self.p0 is None or self.p1 is None or self.p1 <= self.p0:
            return {}
        units = self.p1 - self.p0
        wall = self.t1 - self.t0
        by: dict[str, float] = {}
        for pid, c1 in self.last.items():
            lab = self.labels[pid]
            lab = "worker" if lab.startswith("worker:") else lab
            by[lab] = by.get(lab, 0.0) + (c1 - self.first[pid])
        return {"units": units, "wall_s": round(wall, 3), "cpu_s_per_unit": round(sum(by.values()) / units, 5),
                "cpu_s_per_unit_by_role": {k: round(v / units, 5) for k, v in sorted(by.items())},
                "cores_busy": round(sum(by.values()) / wall, 2) if wall > 0 else None}


# ---------------------------------------------------------------------------------------- statistics
def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def quantile(xs: Iterable[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def rnd(x: Any, nd: int = 4) -> Any:
    if isinstance(x, float):
        return round(x, nd)
    if isinstance(x, dict):
        return {k: rnd(v, nd) for k, v in x.items()}
    if isinstance(x, list):
        return [rnd(v, nd) for v in x]
    return x


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def provenance(root: Path = ROOT) -> dict[str, Any]:
    """What a results file was measured on: the git commit (full sha) of `root`, whether its tree had uncommitted
    changes (`dirty`, with the first changed paths; the results files themselves, bench/results/ and
    docs/resnet_accuracy.json, are left out, since re-measuring rewrites them as it goes), and the UTC date. Every bench script puts these three fields at the top of its JSON
    (scripts/readme_tables.py refuses a results file without them). git runs with safe.directory set, so a script
    run as root (bench/cluster.py) still reads a checkout owned by someone else."""
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", f"safe.directory={root}", "-C", str(root), *args], capture_output=True,
                              text=True, check=True, timeout=30).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = git("status", "--porcelain", "--", ".", ":(exclude)bench/results",
                      ":(exclude)docs/resnet_accuracy.json").splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        return {"commit": None, "dirty": None, "date": date, "commit_note": f"git could not say: {exc}"[:500]}
    out: dict[str, Any] = {"commit": commit, "dirty": bool(changed), "date": date}
    if changed:
        out["dirty_paths"] = [line[3:] for line in changed[:20]] + ([f"... {len(changed) - 20} more"]
                                                                   if len(changed) > 20 else [])
    return out


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0],
            "loadavg_at_start": load_avg()}


def record_error(result: dict[str, Any], exc: BaseException) -> None:
    result["error"] = f"{type(exc).__name__}: {exc}"[:2000]


def finish(result: dict[str, Any], work: Path, keep: bool, t_start: float) -> None:
    """Every script's last step, on success, failure or interruption: stop what it started, drop (or
    name) its working directory, and print the (partial) result with its wall time."""
    stop_all_groups()
    result["bench_wall_s"] = round(time.monotonic() - t_start, 1)
    if keep:
        result["workdir"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    emit_result(result)


def workdir(prefix: str, keep: bool = False) -> Path:
    base = Path(os.environ.get("CMEMI_BENCH_TMP", tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=f"cmemi-bench-{prefix}-", dir=base))


# ---------------------------------------------------------------------------------------- cmemi up
def cmemi_config(name: str, run_dir: Path, workload: dict[str, Any], *, steps: int, microbatches: int,
                 workers: int, spares: int = 0, ckpt_every: int = 0, keep_last: int = 3,
                 global_batch: int | None = None, checksum: bool = True, momentum: float = 0.9,
                 **cluster: Any) -> dict[str, Any]:
    return {
        "run": {"name": name, "dir": str(run_dir), "seed": 0},
        "model": workload["model"],
        "data": workload["data"],
        "optimizer": {"name": "SGD", "kwargs": {"lr": workload.get("lr", 0.01), "momentum": momentum}},
        "train": {"steps": steps, "global_batch": global_batch or workload["global_batch"],
                  "microbatches": microbatches},
        "cluster": {"workers": workers, "spare_workers": spares, "threads_per_worker": 1, "checksum": checksum,
                    **cluster},
        "checkpoint": {"every_steps": ckpt_every, "keep_last": keep_last},
    }


def write_yaml(path: Path, cfg: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class CmemiRun:
    """`python -m cmemi up CONFIG --overwrite` in its own process group, with its Redis for inspection.

    Use as a context manager: the whole cluster (embedded Redis included) is gone on exit.
    """

    def __init__(self, cfg: dict[str, Any], base: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg["run"]["dir"])
        self.name = cfg["run"]["name"]
        base.mkdir(parents=True, exist_ok=True)
        self.config_path = write_yaml(base / f"{self.name}.yaml", cfg)
        self.log_path = base / f"{self.name}.log"
        self.group: ProcGroup | None = None
        self._redis = None
        self.t_start = 0.0
        self.t_end: float | None = None
        self.rc: int | None = None

    def __enter__(self) -> CmemiRun:
        import shutil

        shutil.rmtree(self.run_dir, ignore_errors=True)  # a stale cluster.json would point at a dead Redis
        self.t_start = time.time()
        # (in ROOT, read now: bench/recovery_log.py --base points it at another commit's tree, whose code then runs)
        self.group = ProcGroup([PY, "-m", "cmemi", "up", str(self.config_path), "--overwrite"], self.log_path,
                               cwd=ROOT)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.group is not None:
            rc = self.group.stop(grace=20)
            if self.rc is None:
                self.rc = rc
        if self._redis is not None:
            try:
                self._redis.close()
            except Exception:
                pass
            self._redis = None

    # --- Redis
    @property
    def redis(self):
        if self._redis is None:
            from cmemi.shared.coordination.membership import connect

            info = poll(self._info, 120, "cluster.json of the run")
            self._redis = connect(info["redis"])
        return self._redis

    def _info(self) -> dict[str, Any] | None:
        assert self.group is not None
        if not self.group.alive:
            raise RuntimeError(f"cmemi up exited early ({self.group.popen.returncode}):\n{self.group.tail()}")
        path = self.run_dir / "cluster.json"
        return json.loads(path.read_text()) if path.is_file() else None

    @property
    def keys(self):
        from cmemi.shared.coordination.keys import Keys

        return Keys(self.name)

    def step(self) -> int:
        try:
            return int(self.redis.hget(self.keys.progress, "step") or 0)
        except Exception:
            return 0

    def wait_step(self, n: int, timeout: float) -> int:
        def ok() -> int:
            if not self.group.alive:
                raise RuntimeError(f"cmemi up exited ({self.group.popen.returncode}) before step {n}:\n{self.group.tail()}")
            s = self.step()
            return s if s >= n else 0
        return poll(ok, timeout, f"step {n}", interval=0.01)

    def member(self, role: str, ident: str) -> dict[str, str]:
        return self.redis.hgetall(self.keys.member(role, ident))

    def members(self, role: str) -> dict[str, dict[str, str]]:
        from cmemi.shared.coordination.membership import running_members

        return running_members(self.redis, self.keys, role)

    def pid(self, role: str, ident: str) -> int | None:
        rec = self.member(role, ident)
        return int(rec["pid"]) if rec.get("pid") else None

    def ready_spares(self) -> int:
        """Warm spares blocked in BLPOP on their spare list (i.e. loaded and waiting for an identity)."""
        n = 0
        for c in self.redis.client_list():
            if c.get("cmd") == "blpop" and "b" in c.get("flags", ""):
                n += 1
        return n

    def kill(self, role: str, ident: str, sig: int = signal.SIGKILL) -> tuple[int, float]:
        """Record a `fault_injected` event (as tests/helpers/chaos.py does), then signal the process. Returns (pid, t)."""
        from cmemi.shared.coordination.membership import emit

        rec = self.member(role, ident)
        pid = int(rec["pid"])
        emit(self.redis, self.keys, "fault_injected", role=role, id=ident, incarnation=int(rec["incarnation"]),
             signal=signal.Signals(sig).name, pid=pid)
        t = time.time()
        os.kill(pid, sig)
        return pid, t

    def wait(self, timeout: float) -> int:
        assert self.group is not None
        rc = self.group.wait(timeout)
        if rc is None:
            raise TimeoutError(f"cmemi up did not finish within {timeout:g}s; log {self.log_path}:\n{self.group.tail()}")
        self.rc = rc
        self.t_end = time.time()
        return rc

    def terminate(self) -> int | None:
        """Graceful stop of an unfinished run (SIGTERM to `cmemi up`), then the whole group."""
        assert self.group is not None
        self.rc = self.group.stop(grace=20)
        self.t_end = time.time()
        return self.rc

    # --- run directory
    def metrics(self) -> list[dict[str, Any]]:
        p = self.run_dir / "metrics.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []

    def events(self) -> list[dict[str, Any]]:
        p = self.run_dir / "events.jsonl"
        if not p.exists():
            return []
        evs = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        return sorted(evs, key=lambda e: e["t"])

    def summary(self) -> dict[str, Any] | None:
        p = self.run_dir / "summary.json"
        return json.loads(p.read_text()) if p.exists() else None


def step_stats(metrics: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Median step_time_s after `warmup` steps, and the wall time per step over the same steps (from `t`)."""
    rows = [m for m in metrics if m["step"] > warmup and "step_time_s" in m]  # (a replayed line has no times)
    out: dict[str, Any] = {"steps_measured": len(rows)}
    if not rows:
        return out
    out["step_time_median_s"] = median(m["step_time_s"] for m in rows)
    out["step_time_p90_s"] = quantile([m["step_time_s"] for m in rows], 0.9)
    first = next((m for m in metrics if m["step"] == warmup), None)
    if first is not None and len(rows) >= 1:
        out["wall_per_step_s"] = (rows[-1]["t"] - first["t"]) / (rows[-1]["step"] - warmup)
    return out


class JsonlTail:
    """Incrementally read a JSON-lines file another process appends to (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.rows: list[dict[str, Any]] = []
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.rows
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                self.rows.append(json.loads(line))
        return self.rows


def safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", s)
