"""An emulated cluster: N hosts as network namespaces on one bridge, every link shaped to a fixed rate.

    sudo .venv/bin/python bench/cluster.py [--quick] [--out bench/results/cluster.json]

Needs root (network namespaces, veths, `tc`); without them it says why in one line and exits 2. Not part of
`make bench`. Every host's veth is shaped with `tc ... tbf` at both ends (the host's eth0 and its bridge port,
i.e. each direction; this kernel has no netem, so there is rate but no added delay), at a rate per N (default
200 / 100 / 50 Mbit/s at N = 2 / 4 / 8: the bytes per step grow with N while the 2 cores do not, so a lower rate
keeps the CPU partly idle and the links the limit; each run records both, and the packets each tbf dropped), and
every host uses the TCP congestion control `--tcp-cc` (default cubic, Linux's default). One
extra namespace is the server host. For N = 2, 4, 8 (--quick: 2, 4, fewer steps), all in one run, one after the other:

- `ddp`, `ddp_powersgd`: bench/torch_train.py as N gloo ranks, one per host, rendezvous env:// with
  MASTER_ADDR on host 0 (how torchrun starts them, minus the agent); dense, and with torch's PowerSGD
  communication hook (rank 2, dense for the first 2 steps);
- `cmemi_k1`, `cmemi_k1_powersgd`, `cmemi_k1_topk`: CMEMI with ONE aggregator (K = 1), started by hand as
  the manual's Separate hosts page says: Redis, coordinator (--supervise none), checkpointer and aggregator on the
  server host, one worker per host; CurveZMQ on (the default); `compression.codec` none / powersgd / topk;
- `cmemi_kn`: K = N parameter-server shards (`cluster.shards`), shard k on worker host k (co-located);
- `cmemi_kn_dedicated`: K = N shards on N more namespaces of their own (dedicated CPU server hosts, BytePS'
  placement);
- `cmemi_kn_pipelined`: pipelined steps (`cluster.pipeline_stages`, --stages, default 4) on dedicated server
  hosts: the leader, which then holds no parameters, on the server host, and N shards on the N server hosts
  (K = N + 1): each server steps each stage of its slice as soon as it is in and sends it back while later
  stages still arrive;
- `cmemi_kn_nocurve`: `cmemi_kn` with `security.curve: false` (gloo encrypts nothing: what encryption costs);
- `cmemi_kn_powersgd`: `cmemi_kn` with `compression.codec: powersgd` (the parameters still go back dense);
- `cmemi_kn_powersgd2`, `cmemi_k1_powersgd2`, `cmemi_kn_dedicated_powersgd2`, `cmemi_kn_topk2`, `cmemi_k1_topk2`:
  compressed both ways, `compression.downlink` the same codec as `compression.codec` (docs/design.md §9);
- `cmemi_kn_powersgd_sign`, `cmemi_k1_powersgd_sign`, `cmemi_kn_dedicated_powersgd_sign`: `powersgd` up and
  `compression.downlink: sign` (the parameters' changes as scaled signs, 1 bit each);
- `cmemi_kn_powersgd2_r8`, `cmemi_k1_powersgd2_r8`, `cmemi_kn_dedicated_powersgd2_r8`: `powersgd` both ways at
  `compression.powersgd_rank: 8` (the rank that keeps an AdamW transformer's loss within 2 % of dense both ways,
  bench/compression.py); DDP's hook stays at rank 2.
- `<system>_nolog` (any CMEMI system above but the pipelined one, local steps included, e.g. `cmemi_k1_nolog`, `cmemi_kn_powersgd2_r8_nolog`): the
  same with `checkpoint.step_log: false`; `ratios.<system>_steplog_overhead` = the step time with the step log (the
  default) over without it, in the same run (issue 47: what keeping the servers' state recoverable costs per step).

`cmemi_local_int8_down`: `cmemi_local` with `int8` changes up and `compression.downlink: int8` (a round starts
from the mirror m_t, docs/design.md §10), so both of a round's slices are a quarter of fp32's.
`cmemi_local_rare`: whole rounds, `int4` up, `compression.downlink: int4`, one server and `train.state_every: 8` (a replica's state up every 8 rounds, issue 48);
`cmemi_local_rare_every`: the same with a state every round, its same-run baseline.
`cmemi_local_rare_kn`: `cmemi_local_rare` at K = N (a shard on every worker host, as `cmemi_kn`): each host's link
carries (N - 1)/N of the coded slices each way instead of the one server's link carrying all N replicas' (issue 48).

Local steps (`cmemi_local`, `cmemi_local_stream`, `cmemi_local_int8_down`) record their samples/s as a fraction of the emulated compute
bound (`of_emulated_compute_bound`: N replicas that only sleep their 20 ms per inner step) and, with
`--compute-bound`, of the same system measured again in the same run with every link at `--bound-rate`
(`of_measured_compute_bound`: what the links cost, on the machine's CPU at about the same load), and the
step time each placement of the replicas' states would take on these links (`placement_bounds_s`,
bench/physics.py's `local_step_bounds_s`). Their replicas' states are spread over the shards (replica r on shard
r mod K, `train.inner_states: shards`); `cmemi_local_leaderstates` and `cmemi_local_stream_leaderstates` keep them all
on the leader (the placement before issue 48), the baseline to measure the spread against in the same run.

`--slow-host F` measures each system once more with the last worker host's link at F times the rate (the others
unchanged; co-located shards: that host's shard too): `slow_host` holds that run, `slow_host_vs_all_fast` its
samples/s over the all-fast run's and `slow_host_goal` (N - 1 + F) / N, issue 48's "a slow host costs its share".
With `--pace-off-too`, local steps also run it with `cluster.pace_replicas: false` (`slow_host_pace_off`,
`slow_host_pace_off_vs_all_fast`): the leader's slow-host policy on and off, in the same run.

`--backward-ms` adds emulated compute to the backward pass too (between the layers, for both systems), and
`--mlp IN,HIDDEN,DEPTH` changes the MLP. `--timeline` runs CMEMI at CMEMI_LOG_LEVEL=DEBUG and records each run's
`timeline` (bench/round_timeline.py): where a step's (a round's) time goes, parameters out to compute to the next step.

Workload: the MLP 784-512-512-10 (2.68 MB of fp32 parameters), batch 64 per worker, SGD (momentum 0.9),
one microbatch per worker (train.microbatches = N, global batch 64·N), 20 ms of emulated compute per
forward pass (`bench.cluster_models:sleepy_mlp`, the same for both systems). Step time = median after
warm-up (CMEMI: over the steps where all N workers are admitted); samples/s = 64·N / that median. During
each run's measured steps the machine's CPU idle (from /proc/stat) and the CPU used by the run's own
processes are recorded, to show whether the shared 2 cores were the limit, and per step the CPU
milliseconds of each role (DDP rank, worker, leader, shard, coordinator, checkpointer) and of the
machine (user, system, softirq: the kernel's share, mostly the emulated network): a profile of where a
CPU-bound run's time goes. The physics bounds
(bench/physics.py) stand next to the figures.

Prints one JSON object (also on failure, with `error`); `--out PATH` saves it too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench import round_timeline  # noqa: E402
from bench.physics import comm_bounds_s, local_step_bounds_s  # noqa: E402
from tests.helpers import netns  # noqa: E402

SCRIPT = C.ROOT / "bench" / "torch_train.py"
SLEEP_MS = 20.0
RATES = "2:200mbit,4:100mbit,8:50mbit"
BATCH = 64
MODEL = {"factory": "bench.cluster_models:sleepy_mlp",
         "kwargs": {"in_dim": 784, "hidden": 512, "depth": 3, "classes": 10, "sleep_ms": SLEEP_MS}}
DATA = {"factory": "bench.models:synthetic", "kwargs": {"n": 4096, "shape": [784]}}
POWERSGD_RANK = 2  # CMEMI's compression.powersgd_rank default; DDP's hook gets the same (a "_rR" system: rank R)
# Fixed ports are safe here: each namespace is private to this run and holds nothing else.
REDIS_PORT, MASTER_PORT, PROBE_PORT = 6379, 29500, 5201
ROLES = {"w": "worker", "shard": "shard k > 0", "aggregator": "leader (shard 0)"}  # process name -> role
SYSTEMS = ("ddp", "cmemi_k1", "cmemi_kn", "cmemi_kn_dedicated", "cmemi_kn_pipelined", "cmemi_kn_nocurve", "ddp_powersgd", "cmemi_k1_powersgd",
           "cmemi_kn_powersgd", "cmemi_k1_topk", "cmemi_kn_powersgd2", "cmemi_k1_powersgd2", "cmemi_kn_dedicated_powersgd2",
           "cmemi_kn_topk2", "cmemi_k1_topk2", "cmemi_kn_powersgd_sign", "cmemi_k1_powersgd_sign",
           "cmemi_kn_dedicated_powersgd_sign", "cmemi_kn_powersgd2_r8", "cmemi_k1_powersgd2_r8",
           "cmemi_kn_dedicated_powersgd2_r8", "cmemi_local", "cmemi_local_stream", "cmemi_local_leaderstates",
           "cmemi_local_stream_leaderstates", "cmemi_local_int8_down", "cmemi_local_rare", "cmemi_local_rare_every",
           "cmemi_local_rare_kn")
BOTH_WAYS = tuple(k for k in SYSTEMS if re.sub(r"_r\d+$", "", k).endswith(("2", "_sign")))  # compressed both ways
LOCAL_STEPS = 200  # cmemi_local's train.local_steps (--local-steps)
FRAGMENTS = 4  # cmemi_local_stream's train.fragments (--fragments)


# ---------------------------------------------------------------------------------------- links
def allow_congestion_control(algorithm: str) -> None:
    """Let network namespaces choose `algorithm` (net.ipv4.tcp_allowed_congestion_control: a namespace may only
    pick an allowed one); the machine's own default is left as it is."""
    path = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    allowed = path.read_text().split()
    if algorithm not in allowed:
        path.write_text(" ".join([*allowed, algorithm]))


def congestion_control(host: netns.Host, algorithm: str) -> None:
    """The host's TCP congestion control (per network namespace), e.g. cubic, Linux's default."""
    r = subprocess.run(["ip", "netns", "exec", host.ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={algorithm}"],
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise RuntimeError(f"--tcp-cc {algorithm}: {r.stderr.strip()} (see net.ipv4.tcp_available_congestion_control)")


def tbf_drops(lab: netns.NetLab, hosts: list[netns.Host]) -> dict[str, dict[str, int]]:
    """Packets each host's tbfs have dropped so far (a queue full: `latency` 100 ms of data), uplink (host -> bridge)
    and downlink (bridge -> host): TCP losses, each one a retransmission and, in an incast, a timeout."""
    out: dict[str, dict[str, int]] = {}
    for h in hosts:
        for way, ns, dev in (("up", h.ns, "eth0"), ("down", lab.bridge_ns, h.port_if)):
            r = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
                               capture_output=True, text=True, timeout=20)
            m = re.search(r"dropped (\d+)", r.stdout)
            out.setdefault(h.name, {})[way] = int(m.group(1)) if m else 0
    return out


def drops_between(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Packets dropped between two `tbf_drops` readings: summed per direction, and per host where any were."""
    diff = {h: {w: after[h][w] - before[h][w] for w in after[h]} for h in after}
    return {"up": sum(d["up"] for d in diff.values()), "down": sum(d["down"] for d in diff.values()),
            "by_host": {h: d for h, d in diff.items() if any(d.values())}}


PROBE_RECV = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(4)
while True:
    c, _ = s.accept(); n = 0
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        n += len(b)
    if n:
        c.sendall(b"k"); print(n); break
    c.close()
"""
PROBE_SEND = """
import socket, sys, time
deadline = time.monotonic() + 20
while True:
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
data = bytes(int(sys.argv[3])); t0 = time.perf_counter()
c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.perf_counter() - t0)
"""


def probe_rate(src: netns.Host, dst: netns.Host, nbytes: int) -> float:
    """Achieved TCP goodput src -> dst in Mbit/s (checks that the shaping is in place)."""
    recv = subprocess.Popen(["ip", "netns", "exec", dst.ns, C.PY, "-c", PROBE_RECV, dst.ip, str(PROBE_PORT)],
                            stdout=subprocess.PIPE, text=True)
    try:
        out = subprocess.run(["ip", "netns", "exec", src.ns, C.PY, "-c", PROBE_SEND, dst.ip, str(PROBE_PORT),
                              str(nbytes)], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"link probe {src.name} -> {dst.name} failed: {out.stderr.strip()[-500:]}")
        recv.wait(timeout=20)
        return nbytes * 8 / float(out.stdout.strip()) / 1e6
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(timeout=10)


# ---------------------------------------------------------------------------------------- CPU
class CpuSampler:
    """Samples /proc/stat (the whole machine: user, system, softirq, idle) and the CPU time of the processes
    being watched, by role, every 0.2 s: where a run's CPU goes, per step."""

    MACHINE = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[int], dict[str, float], float]] = []  # (t, /proc/stat, role -> s, load)
        self.watched: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def watch(self, pids: dict[int, str]) -> None:
        for pid, role in pids.items():
            self.watched.setdefault(pid, (role, 0.0))

    def _loop(self) -> None:
        while not self._stop.is_set():
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            by_role: dict[str, float] = {}
            for pid, (role, _last) in list(self.watched.items()):
                cpu = C.cpu_seconds(pid)
                if cpu is not None:  # a process that exited keeps its last reading
                    self.watched[pid] = (role, cpu)
                by_role[role] = by_role.get(role, 0.0) + self.watched[pid][1]
            self.samples.append((time.time(), fields, by_role, os.getloadavg()[0]))
            self._stop.wait(0.2)

    def window(self, t0: float, t1: float, steps: int) -> dict[str, Any]:
        """Between wall-clock t0 and t1 (`steps` steps): the machine's idle cores and the cores the run's own
        processes kept busy; per step, the CPU milliseconds of each role and the machine's split (user, system,
        softirq: the kernel's share is mostly the emulated network)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {"samples": len(inside)}
        a, b = inside[0], inside[-1]
        cpus, hz = os.cpu_count() or 1, os.sysconf("SC_CLK_TCK")
        delta = [y - x for x, y in zip(a[1], b[1], strict=False)]
        total = sum(delta[:8])
        idle = (delta[3] + delta[4]) / total if total > 0 else None
        ours = sum(b[2].values()) - sum(a[2].get(r, 0.0) for r in b[2])
        scale = (t1 - t0) / (b[0] - a[0]) / max(1, steps) * 1000  # CPU seconds over the samples -> ms per step
        return {"seconds": round(b[0] - a[0], 2), "machine_idle_fraction": C.rnd(idle, 3),
                "machine_idle_cores": C.rnd(idle * cpus if idle is not None else None, 2),
                "this_run_cores_busy": round(ours / (b[0] - a[0]), 2), "cpus": cpus,
                "loadavg_1min": [round(min(s[3] for s in inside), 2), round(max(s[3] for s in inside), 2)],
                "ms_per_step_by_role": {r: round((b[2][r] - a[2].get(r, 0.0)) * scale, 1) for r in sorted(b[2])
                                        if b[2][r] > a[2].get(r, 0.0)},
                "ms_per_step_machine": {n: round(delta[i] / hz * scale, 1) for i, n in enumerate(self.MACHINE)
                                        if n in ("user", "system", "softirq", "idle")}}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------- the runs
class Cluster:
    def __init__(self, lab: netns.NetLab, server: netns.Host, hosts: list[netns.Host], work: Path,
                 sampler: CpuSampler, redis_url: str, keys: Path, servers: list[netns.Host]) -> None:
        self.lab, self.server, self.hosts, self.work, self.servers = lab, server, hosts, work, servers
        self.sampler, self.redis_url, self.keys = sampler, redis_url, keys
        self.runs = 0
        self.patience = 1.0  # --patience: every run's deadline times this (a machine loaded by others)
        self.timeline = False  # --timeline: CMEMI runs log each lease's and step's times (bench/round_timeline.py)

    def _wait(self, procs: dict[str, subprocess.Popen], names: list[str], deadline: float, logs: Path) -> None:
        for k in names:
            try:
                rc = procs[k].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{k} did not finish in time{tails(logs)}") from None
            if rc != 0:
                raise RuntimeError(f"{k} exited with {rc}{tails(logs)}")

    def ddp(self, n: int, steps: int, warmup: int, powersgd: bool) -> dict[str, Any]:
        self.runs += 1
        tag = f"ddp{'_powersgd' if powersgd else ''}-n{n}-{self.runs}"
        logs = self.work / tag
        logs.mkdir()
        workload = {"model": MODEL, "data": DATA, "global_batch": BATCH * n, "lr": 0.01}
        out, events = logs / "result.json", logs / "events.jsonl"
        procs = {}
        port = MASTER_PORT + self.runs  # a fresh port per run: nothing of an earlier run can hold it
        for r in range(n):
            env = C.env(1, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                        MASTER_ADDR=self.hosts[0].ip, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0")
            argv = [C.PY, str(SCRIPT), "--workload", json.dumps(workload), "--steps", str(steps),
                    "--warmup", str(warmup), "--out", str(out), "--events", str(events)]
            if powersgd:
                argv += ["--powersgd-rank", str(POWERSGD_RANK)]
            procs[f"rank{r}"] = self.lab.start(self.hosts[r], argv, logs / f"rank{r}.log", env=env, cwd=C.ROOT)
        self.sampler.watch({p.pid: "ddp rank" for p in procs.values()})
        try:
            self._wait(procs, list(procs), time.monotonic() + 180 + steps * 5, logs)
        finally:  # a hung or failed rank must not keep the rendezvous port or the links busy
            for p in procs.values():
                self.lab.stop(p)
        res = json.loads(out.read_text())
        t = {e["step"]: e["t"] for e in C.JsonlTail(events).read() if e["kind"] == "step"}
        median = res["step_time_median_s"]
        return {"steps": steps, "steps_measured": steps - warmup, "step_time_median_s": C.rnd(median, 5),
                "samples_per_s": round(BATCH * n / median, 1), "wall_per_step_s": C.rnd(res["wall_per_step_s"], 5),
                "cpu": self.sampler.window(t[warmup], t[steps], steps - warmup)}

    def cmemi(self, n: int, steps: int, warmup: int, codec: str, shards: int = 1, dedicated: bool = False,
              curve: bool = True, stages: int = 0, downlink: str = "none", local_steps: int = 0,
              rank: int = POWERSGD_RANK, fragments: int = 1, step_log: bool = True,
              inner_states: str = "shards", pace: bool = True, state_every: int = 1) -> dict[str, Any]:
        """`shards` > 1: shard k on worker host k, or (`dedicated`) on server host k of its own. `stages`
        (pipelined, dedicated): the leader on the server host, shard k on server host k - 1. `downlink`:
        compression.downlink. `local_steps` (H): train.local_steps with N replicas, `steps` and `warmup` in rounds
        (`fragments` F > 1, streaming: in segments of H / F inner steps); a step's figures are then a round's (a
        segment's), and a round trains H times the samples (a segment H / F). `pace`: cluster.pace_replicas. `state_every`: train.state_every (D)."""
        from cmemi.shared.config.loading import dump_config, load_config

        down = "" if downlink == "none" else f"-down{downlink}"
        segment = max(1, local_steps // fragments)  # inner steps per step of the servers
        name = (f"cluster-n{n}-k{shards}{'d' if dedicated else ''}-{codec}{down}{f'-h{local_steps}' if local_steps else ''}"
                f"{f'-f{fragments}' if fragments > 1 else ''}"
                f"{f'-r{rank}' if rank != POWERSGD_RANK else ''}"
                f"-{secrets.token_hex(3)}")
        logs = self.work / name
        logs.mkdir()
        run_dir = logs / "run"
        cfg = C.cmemi_config(name, run_dir, {"model": MODEL, "data": DATA, "global_batch": BATCH * n, "lr": 0.01},
                             steps=steps * segment, microbatches=n, workers=n, spares=0, ckpt_every=0)
        if local_steps:
            cfg["train"].update(local_steps=local_steps, replicas=n, fragments=fragments, inner_states=inner_states,
                                state_every=state_every)
        cfg["compression"] = {"codec": codec, "powersgd_rank": rank, "downlink": downlink}
        cfg["cluster"]["shards"] = shards
        cfg["cluster"]["pipeline_stages"] = stages
        cfg["security"] = {"keys_dir": str(self.keys), "curve": curve}
        cfg["checkpoint"]["step_log"] = step_log
        cfg["cluster"]["pace_replicas"] = pace
        cfg_path = C.write_yaml(logs / "config.yaml", cfg)
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(dump_config(load_config(cfg_path, [])))
        env = C.env(1, CMEMI_REDIS_URL=self.redis_url,  # the password stays out of argv
                    **({"CMEMI_LOG_LEVEL": "DEBUG"} if self.timeline else {}))

        def start(role: str, host: netns.Host, *extra: str, log: str) -> subprocess.Popen:
            argv = [C.PY, "-m", "cmemi", role, "--config", str(cfg_path), "--set", f"cluster.host={host.ip}", *extra]
            return self.lab.start(host, argv, logs / f"{log}.log", env=env, cwd=C.ROOT)

        procs = {"coordinator": start("coordinator", self.server, "--supervise", "none", log="coordinator"),
                 "checkpointer": start("checkpointer", self.server, log="checkpointer")}
        # workers before the aggregator: they import torch meanwhile, so they join the first steps together
        for i in range(n):
            procs[f"w{i}"] = start("worker", self.hosts[i], "--worker-id", f"w{i}", log=f"w{i}")
        places = (self.servers if dedicated else self.hosts)[:shards] if shards > 1 else [self.server]
        if stages:
            places = [self.server, *self.servers[:shards - 1]]
        procs["aggregator"] = start("aggregator", places[0], log="aggregator")
        for k in range(1, shards):
            procs[f"shard{k}"] = start("aggregator", places[k], "--shard", str(k), log=f"aggregator-{k}")
        self.sampler.watch({p.pid: ROLES.get(k.rstrip("0123456789"), k) for k, p in procs.items()})
        try:
            self._wait(procs, ["aggregator", *(f"w{i}" for i in range(n))],
                       time.monotonic() + self.patience * (240 + steps * (1 + 0.5 * n + 2 * segment * SLEEP_MS / 1000)),
                       logs)
        finally:
            for p in procs.values():
                self.lab.stop(p)
        rows = [m for m in C.JsonlTail(run_dir / "metrics.jsonl").read() if "step_time_s" in m]
        full = [m["step"] for m in rows if m.get("live_workers", 0) >= n]
        first = (full[0] if full else steps) + warmup  # steps after all N workers are admitted, then warm-up
        measured = [m for m in rows if m["step"] > first]
        if len(measured) < 3:
            raise RuntimeError(f"only {len(measured)} steps with all {n} workers after warm-up: make the run longer")
        median = C.median(m["step_time_s"] for m in measured)
        at = {m["step"]: m["t"] for m in rows}
        summary = json.loads((run_dir / "summary.json").read_text())
        samples = BATCH * n * segment  # per step (a round: H inner steps of every replica; a segment H / F)
        moved = summary["bytes_sent"] + summary["bytes_received"]
        return {"steps": steps, "steps_measured": len(measured), "first_measured_step": first + 1,
                **({"local_steps": local_steps, "replicas": n, "pace_replicas": pace,
                    "inner_states_sent": summary.get("inner_states_sent"),
                    "replicas_by_worker": summary.get("replicas_by_worker"),
                    "replica_share_cuts": summary.get("replica_share_cuts")} if local_steps else {}),
                **({"fragments": fragments, "segments_ahead": summary.get("segments_ahead"),
                    "changes_sent": summary.get("changes_sent")} if fragments > 1 else {}),
                "step_time_median_s": C.rnd(median, 5), "samples_per_s": round(samples / median, 1),
                "bytes_per_sample": round(moved / (summary["steps"] * samples), 1),
                "wall_per_step_s": C.rnd((measured[-1]["t"] - at[first]) / len(measured), 5),
                "bytes_from_workers_per_step": round(summary["bytes_sent"] / summary["steps"]),
                "bytes_to_workers_per_step": round(summary["bytes_received"] / summary["steps"]),
                "duplicate_param_sends": summary.get("duplicate_param_sends"),
                "cpu": self.sampler.window(at[first], measured[-1]["t"], len(measured)),
                **({"timeline": round_timeline.summary(logs, n)} if self.timeline else {})}


def tails(logs: Path, n: int = 1200) -> str:
    out = []
    for f in sorted(logs.glob("*.log")):
        out.append(f"\n---- {f.name}\n{f.read_text(errors='replace')[-n:]}")
    return "".join(out)


def start_redis(lab: netns.NetLab, server: netns.Host, work: Path) -> str:
    from cmemi.launcher.redis_server import redis_server_binary

    password = secrets.token_hex(16)
    d = work / "redis"
    d.mkdir()
    lab.start(server, [redis_server_binary(), "--port", str(REDIS_PORT), "--bind", server.ip, "--requirepass",
                       password, "--save", "", "--appendonly", "no", "--dir", str(d), "--logfile",
                       str(d / "redis.log")], d / "stdout.log")
    C.poll(lambda: (d / "redis.log").is_file() and "Ready to accept" in (d / "redis.log").read_text(), 30,
           "redis-server ready")
    return f"redis://:{password}@{server.ip}:{REDIS_PORT}/0"


def param_bytes() -> int:
    from bench.cluster_models import sleepy_mlp

    return sum(p.numel() * p.element_size() for p in sleepy_mlp(**MODEL["kwargs"]).parameters())


def rate_bit_s(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"--rate {rate!r}: write it as <number>kbit, mbit or gbit (tc's units), e.g. 200mbit")


def rates_by_n(spec: str, ns_: list[int]) -> dict[int, str]:
    """`--rate`: one rate for every N ("200mbit"), or one per N ("2:200mbit,4:100mbit,8:50mbit")."""
    if ":" not in spec:
        rate_bit_s(spec)
        return dict.fromkeys(ns_, spec)
    out = {}
    for item in spec.split(","):
        n, _, rate = item.partition(":")
        rate_bit_s(rate)
        out[int(n)] = rate
    if missing := [n for n in ns_ if n not in out]:
        raise ValueError(f"--rate {spec!r} names no rate for N = {missing}")
    return out


def summarise(n: int, runs: dict[str, Any], pbytes: int, rate: float) -> dict[str, Any]:
    b = comm_bounds_s(n, pbytes, rate)
    sleep = (SLEEP_MS + MODEL["kwargs"].get("backward_ms", 0.0)) / 1000  # emulated compute per step
    med = {k: r.get("step_time_median_s") for k, r in runs.items()}
    per_sample = {k: 1 / r["samples_per_s"] for k, r in runs.items() if r.get("samples_per_s")}
    return {
        "bounds_comm_only_s": C.rnd(b, 4),
        "bounds_with_compute_s": C.rnd({k: v + sleep for k, v in b.items()}, 4),
        "ratios": {
            "cmemi_k1_vs_ddp": C.ratio(med.get("cmemi_k1"), med.get("ddp")),
            "cmemi_kn_vs_ddp": C.ratio(med.get("cmemi_kn"), med.get("ddp")),
            "cmemi_kn_dedicated_vs_ddp": C.ratio(med.get("cmemi_kn_dedicated"), med.get("ddp")),
            "cmemi_kn_pipelined_vs_ddp": C.ratio(med.get("cmemi_kn_pipelined"), med.get("ddp")),
            "cmemi_kn_nocurve_vs_ddp": C.ratio(med.get("cmemi_kn_nocurve"), med.get("ddp")),
            "cmemi_kn_powersgd_vs_ddp": C.ratio(med.get("cmemi_kn_powersgd"), med.get("ddp")),
            "cmemi_k1_powersgd_vs_ddp": C.ratio(med.get("cmemi_k1_powersgd"), med.get("ddp")),
            "cmemi_k1_topk_vs_ddp": C.ratio(med.get("cmemi_k1_topk"), med.get("ddp")),
            **{f"{k}_vs_ddp_powersgd": C.ratio(med.get(k), med.get("ddp_powersgd")) for k in BOTH_WAYS},
            "cmemi_k1_powersgd_vs_ddp_powersgd": C.ratio(med.get("cmemi_k1_powersgd"), med.get("ddp_powersgd")),
            # local steps: per sample (a round trains H times a step's samples)
            "cmemi_kn_bytes_per_sample_vs_cmemi_local": C.ratio(runs.get("cmemi_kn", {}).get("bytes_per_sample"),
                                                                runs.get("cmemi_local", {}).get("bytes_per_sample")),
            "cmemi_local_time_per_sample_vs_ddp": C.ratio(per_sample.get("cmemi_local"), per_sample.get("ddp")),
            "cmemi_local_time_per_sample_vs_ddp_powersgd": C.ratio(per_sample.get("cmemi_local"),
                                                                   per_sample.get("ddp_powersgd")),
            # issue 48: the states spread over the shards (default) against all on the leader, same run (> 1: spread
            # is faster)
            **{f"{b}_leaderstates_time_per_sample_vs_{b}": C.ratio(per_sample.get(f"{b}_leaderstates"),
                                                                   per_sample.get(b))
               for b in ("cmemi_local", "cmemi_local_stream")},
            # streaming: against whole rounds of the same H (per sample), and its bytes
            "cmemi_local_stream_time_per_sample_vs_cmemi_local": C.ratio(per_sample.get("cmemi_local_stream"),
                                                                         per_sample.get("cmemi_local")),
            "cmemi_local_stream_time_per_sample_vs_ddp": C.ratio(per_sample.get("cmemi_local_stream"),
                                                                 per_sample.get("ddp")),
            "cmemi_local_stream_time_per_sample_vs_ddp_powersgd": C.ratio(per_sample.get("cmemi_local_stream"),
                                                                          per_sample.get("ddp_powersgd")),
            "cmemi_kn_bytes_per_sample_vs_cmemi_local_stream": C.ratio(
                runs.get("cmemi_kn", {}).get("bytes_per_sample"), runs.get("cmemi_local_stream", {}).get("bytes_per_sample")),
            # whole rounds with int8 both ways (a mirror down): against fp32 whole rounds of the same H
            "cmemi_local_int8_down_time_per_sample_vs_cmemi_local": C.ratio(per_sample.get("cmemi_local_int8_down"),
                                                                            per_sample.get("cmemi_local")),
            "cmemi_local_bytes_per_sample_vs_cmemi_local_int8_down": C.ratio(
                runs.get("cmemi_local", {}).get("bytes_per_sample"),
                runs.get("cmemi_local_int8_down", {}).get("bytes_per_sample")),
            # train.state_every: what a state every RARE_EVERY rounds saves, and costs in time, against every round
            "cmemi_local_rare_every_bytes_per_sample_vs_cmemi_local_rare": C.ratio(
                runs.get("cmemi_local_rare_every", {}).get("bytes_per_sample"),
                runs.get("cmemi_local_rare", {}).get("bytes_per_sample")),
            "cmemi_local_rare_time_per_sample_vs_cmemi_local_rare_every": C.ratio(
                per_sample.get("cmemi_local_rare"), per_sample.get("cmemi_local_rare_every")),
            **{f"{k.removesuffix(NOLOG)}_steplog_overhead": C.ratio(med.get(k.removesuffix(NOLOG)), med.get(k))
               for k in runs if k.endswith(NOLOG)},
            "ddp_vs_ring_bound": C.ratio(med.get("ddp"), b["ring_allreduce_s"] + sleep),
            "cmemi_k1_vs_single_server_sequential_bound": C.ratio(med.get("cmemi_k1"),
                                                                   b["single_server_sequential_s"] + sleep),
        },
        "runs": runs,
    }


LOCAL_SYSTEMS = ("cmemi_local", "cmemi_local_stream", "cmemi_local_leaderstates", "cmemi_local_stream_leaderstates",
                 "cmemi_local_int8_down", "cmemi_local_rare", "cmemi_local_rare_every", "cmemi_local_rare_kn")
RARE_EVERY = 8  # cmemi_local_rare's train.state_every (D)
RARE = ("cmemi_local_rare", "cmemi_local_rare_every", "cmemi_local_rare_kn")  # whole rounds, int4 both ways
LEADER_STATES = "_leaderstates"  # a local-steps system's name + this: every replica's state on the leader (issue 48's
# baseline: train.inner_states leader), measured beside the default (spread, replica r on shard r mod K)


def emulated_compute_bound(n: int, step_ms: float) -> float:
    """Samples/s of N replicas that do nothing but their emulated compute: each inner step is one forward (and
    backward) of `step_ms` on BATCH samples, all N at once (a round or a segment trains BATCH · N per inner step)."""
    return BATCH * n / (step_ms / 1000)


def of_bound(run: dict[str, Any], bound: float | None) -> float | None:
    """A run's samples/s as a fraction of a bound (None where either is missing)."""
    got = run.get("samples_per_s")
    return round(got / bound, 3) if got and bound else None


def with_compute_bound(lab: netns.NetLab, shaped: list[netns.Host], rate: str, back: str, burst: str,
                       measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The same system measured again with the links of `shaped` at `rate`, then shaped back to `back`. Every link far
    above what the run needs: what is left is its compute, the CPU and the servers, the compute bound of the same
    run, on the same machine at about the same load; one host's link lower (--slow-host): what a slow host costs."""
    for h in shaped:
        lab.shape(h, rate, burst)
    try:
        return dict(measure())
    except Exception as exc:  # the shaped run's figures stand without it
        return {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    finally:
        for h in shaped:
            lab.shape(h, back, burst)


NOLOG = "_nolog"  # a synchronous CMEMI system's name + this: the same with checkpoint.step_log false


def known_system(name: str) -> bool:
    base = name.removesuffix(NOLOG)
    return base in SYSTEMS and (name == base or (base.startswith("cmemi") and base != "cmemi_kn_pipelined"))


def run_system(cluster: Cluster, system: str, n: int, steps: int, warmup: int, stages: int,
               local_steps: int = LOCAL_STEPS, fragments: int = FRAGMENTS, pace: bool = True) -> dict[str, Any]:
    step_log = not system.endswith(NOLOG)
    system = system.removesuffix(NOLOG)
    if system.startswith("ddp"):
        return cluster.ddp(n, steps, warmup, powersgd=system == "ddp_powersgd")
    states = "leader" if system.endswith(LEADER_STATES) else "shards"
    system = system.removesuffix(LEADER_STATES)
    if system == "cmemi_local":  # K = N co-located shards, as cmemi_kn; a round is H steps' worth of samples
        return cluster.cmemi(n, max(6, steps // 4), min(2, warmup), "none", shards=n, local_steps=local_steps,
                             inner_states=states, pace=pace, step_log=step_log)
    if system == "cmemi_local_int8_down":  # cmemi_local with int8 changes up and θ's change down in int8 (a mirror)
        return cluster.cmemi(n, max(6, steps // 4), min(2, warmup), "int8", shards=n, local_steps=local_steps,
                             downlink="int8", inner_states=states, pace=pace, step_log=step_log)
    if system in RARE:  # int4 up, int4 down, one server (K = N for cmemi_local_rare_kn), a replica's state up every
        # RARE_EVERY rounds (cmemi_local_rare, _kn) or every round (the same run's D = 1 baseline)
        return cluster.cmemi(n, max(6, steps // 4), min(2, warmup), "int4", shards=n if system.endswith("_kn") else 1,
                             local_steps=local_steps, downlink="int4", inner_states=states, pace=pace,
                             step_log=step_log, state_every=1 if system == "cmemi_local_rare_every" else RARE_EVERY)
    if system == "cmemi_local_stream":  # the same rounds' worth of inner steps, in F segments each
        return cluster.cmemi(n, max(6, steps // 4) * fragments, min(2, warmup) * fragments, "none", shards=n,
                             local_steps=local_steps, fragments=fragments, inner_states=states, pace=pace,
                             step_log=step_log)
    if system == "cmemi_kn_pipelined":
        return cluster.cmemi(n, steps, warmup, "none", shards=n + 1, dedicated=True, stages=stages)
    shape = compressed_system(system)
    if system.startswith("cmemi_kn"):
        return cluster.cmemi(n, steps, warmup, shards=n, dedicated="dedicated" in system,
                             curve=system != "cmemi_kn_nocurve", step_log=step_log, **shape)
    return cluster.cmemi(n, steps, warmup, step_log=step_log, **shape)


def compressed_system(system: str) -> dict[str, Any]:
    """A CMEMI system's compression from its name: the codec it names (powersgd, topk or none); "...2" sends the same
    codec down (compression.downlink), "..._sign" sends sign down; a "_rR" suffix sets powersgd's rank to R."""
    m = re.search(r"_r(\d+)$", system)
    base = system[:m.start()] if m else system
    codec = next((c for c in ("powersgd", "topk") if c in base), "none")
    downlink = codec if base.endswith("2") else "sign" if base.endswith("_sign") else "none"
    return {"codec": codec, "downlink": downlink, "rank": int(m.group(1)) if m else POWERSGD_RANK}


def main() -> None:
    global RARE_EVERY  # --state-every sets it: read by run_system and the systems' descriptions
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N = 2, 4 and fewer steps (to debug)")
    p.add_argument("--hosts", default=None, help="comma-separated N values (default 2,4,8; --quick 2,4)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 30; --quick 14)")
    p.add_argument("--warmup", type=int, default=None, help="steps skipped before measuring (default 5; --quick 3)")
    p.add_argument("--rate", default=RATES, help="every link's rate each way, in tc's units: one for all N, or one "
                   f"per N (default {RATES}: the CPU stays partly idle at every N, so the links are the limit)")
    p.add_argument("--burst", default="64kb", help="tbf bucket size")
    p.add_argument("--stages", type=int, default=8, help="cluster.pipeline_stages of cmemi_kn_pipelined")
    p.add_argument("--local-steps", type=int, default=LOCAL_STEPS, help="train.local_steps of cmemi_local(_stream)")
    p.add_argument("--fragments", type=int, default=FRAGMENTS, help="train.fragments of cmemi_local_stream")
    p.add_argument("--state-every", type=int, default=RARE_EVERY, help="train.state_every of cmemi_local_rare (D: a "
                   "replica's state up every D rounds)")
    p.add_argument("--compute-bound", action="store_true", help="measure cmemi_local(_stream) again with every link "
                   "at --bound-rate: the compute bound of the same run (`of_measured_compute_bound`)")
    p.add_argument("--bound-rate", default="10gbit", help="the links' rate of the --compute-bound runs (default 10gbit)")
    p.add_argument("--slow-host", type=float, default=None, help="also measure each system with the last worker "
                   "host's link at this fraction of the rate (e.g. 0.25): `slow_host`, `slow_host_vs_all_fast`")
    p.add_argument("--pace-off-too", action="store_true", help="with --slow-host, local steps: also measure it with "
                   "cluster.pace_replicas false (`slow_host_pace_off`: a replica stays with its holder), in the same run")
    p.add_argument("--patience", type=float, default=1.0, help="every CMEMI run's deadline times this (default 1; "
                   "more on a machine that others load)")
    p.add_argument("--tcp-cc", default="cubic", help="every host's TCP congestion control (default cubic, Linux's "
                   "default; BBRv1, this machine's, ignores losses, and many flows into one 100 ms queue then lose "
                   "40 %% of their packets)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"a subset of {','.join(SYSTEMS)}; a CMEMI "
                   f"one + {NOLOG}: the same with checkpoint.step_log false")
    p.add_argument("--backward-ms", type=float, default=0.0,
                   help="emulated compute per backward pass too, between the layers (default 0: forward only)")
    p.add_argument("--mlp", default="784,512,3", help="the MLP's input size, hidden width and depth (default 784,512,3)")
    p.add_argument("--out", default=None, help="also write the JSON object here (e.g. bench/results/cluster.json)")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, run dirs)")
    p.add_argument("--timeline", action="store_true", help="CMEMI runs at CMEMI_LOG_LEVEL=DEBUG: each run's `timeline`, "
                   "where a step's time goes (bench/round_timeline.py: parameters out, intake, compute, barrier, "
                   "gradients up, the leader; medians)")
    args = p.parse_args()
    RARE_EVERY = args.state_every
    why = netns.unavailable() or (None if shutil.which("tc") else "the `tc` command (iproute2) is not installed")
    if why is not None:
        print(f"bench/cluster.py needs root and Linux network namespaces with tc: {why}", file=sys.stderr)
        sys.exit(2)
    systems = args.systems.split(",")
    unknown = sorted(s for s in systems if not known_system(s))
    if unknown:
        print(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)} (a synchronous CMEMI one may end in "
              f"{NOLOG})", file=sys.stderr)
        sys.exit(2)
    ns_ = [int(x) for x in (args.hosts or ("2,4" if args.quick else "2,4,8")).split(",")]
    try:
        rates = rates_by_n(args.rate, ns_)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
    steps = args.steps or (14 if args.quick else 30)
    warmup = args.warmup or (3 if args.quick else 5)
    try:
        in_dim, hidden, depth = (int(x) for x in args.mlp.split(","))
    except ValueError:
        print(f"--mlp {args.mlp!r}: give INPUT,HIDDEN,DEPTH, e.g. 784,512,3", file=sys.stderr)
        sys.exit(2)
    MODEL["kwargs"].update(backward_ms=args.backward_ms, in_dim=in_dim, hidden=hidden, depth=depth)
    DATA["kwargs"]["shape"] = [in_dim]
    C.setup(threads=1)
    pbytes = param_bytes()
    work = C.workdir("cluster")
    result: dict[str, Any] = {
        "bench": "cluster", **C.provenance(), "command": " ".join(["python bench/cluster.py", *sys.argv[1:]]),
        "machine": C.machine(), "quick": args.quick, "pipeline_stages": args.stages,
        "link": {"rate": args.rate, "burst": args.burst, "tcp_congestion_control": args.tcp_cc,
                 "shaping": "tc tbf on both ends of every host's veth (each direction); no netem: no added delay"},
        "workload": {"model": f"MLP {in_dim}-" + f"{hidden}-" * (depth - 1) + "10 (bench.cluster_models:sleepy_mlp)",
                     "param_bytes": pbytes,
                     "batch_per_worker": BATCH, "microbatches": "N (one per worker)", "optimizer": "SGD momentum 0.9",
                     "emulated_compute_ms_per_forward": SLEEP_MS, "emulated_compute_ms_per_backward": args.backward_ms,
                     "steps": steps, "warmup_steps": warmup},
        "systems": {
            "ddp": "N gloo ranks (bench/torch_train.py), env:// rendezvous on host 0, dense all-reduce",
            "ddp_powersgd": f"the same with torch's PowerSGD comm hook, rank {POWERSGD_RANK}, from step 3, "
                            "bucket_cap_mb=25 (one bucket: two buckets make the hook abort on gloo)",
            "cmemi_k1": "CMEMI, ONE aggregator (K = 1) on a server host + N workers, started by hand, CurveZMQ on, "
                        "codec none",
            "cmemi_kn": "CMEMI, K = N parameter-server shards (cluster.shards), shard k on worker host k, codec none",
            "cmemi_kn_dedicated": "CMEMI, K = N shards on N dedicated server hosts (namespaces of their own), "
                                  "codec none",
            "cmemi_kn_pipelined": "CMEMI, cluster.pipeline_stages (--stages) with the leader on the server host and N "
                                  "shards on N dedicated server hosts (K = N + 1), codec none",
            "cmemi_kn_nocurve": "cmemi_kn with security.curve false (no CurveZMQ encryption, as gloo has none)",
            "cmemi_kn_powersgd": f"cmemi_kn with compression.codec powersgd (rank {POWERSGD_RANK})",
            "cmemi_k1_powersgd": f"CMEMI K = 1, compression.codec powersgd (rank {POWERSGD_RANK})",
            "cmemi_k1_topk": "CMEMI K = 1, compression.codec topk (topk_ratio 0.01)",
            "cmemi_kn_powersgd2": f"cmemi_kn with powersgd both ways (codec and downlink, rank {POWERSGD_RANK})",
            "cmemi_k1_powersgd2": f"CMEMI K = 1, powersgd both ways (codec and downlink, rank {POWERSGD_RANK})",
            "cmemi_kn_dedicated_powersgd2": f"cmemi_kn_dedicated with powersgd both ways (rank {POWERSGD_RANK})",
            "cmemi_kn_topk2": "cmemi_kn with topk both ways (codec and downlink, topk_ratio 0.01)",
            "cmemi_k1_topk2": "CMEMI K = 1, topk both ways (codec and downlink, topk_ratio 0.01)",
            "cmemi_kn_powersgd_sign": f"cmemi_kn with powersgd up (rank {POWERSGD_RANK}) and downlink sign (1 bit per "
                                      "parameter change)",
            "cmemi_k1_powersgd_sign": f"CMEMI K = 1, powersgd up (rank {POWERSGD_RANK}), downlink sign",
            "cmemi_kn_dedicated_powersgd_sign": f"cmemi_kn_dedicated with powersgd up (rank {POWERSGD_RANK}), downlink sign",
            "cmemi_kn_powersgd2_r8": "cmemi_kn with powersgd both ways at rank 8",
            "cmemi_k1_powersgd2_r8": "CMEMI K = 1, powersgd both ways at rank 8",
            "cmemi_kn_dedicated_powersgd2_r8": "cmemi_kn_dedicated with powersgd both ways at rank 8",
            "cmemi_local": f"cmemi_kn with local steps: train.local_steps {args.local_steps} (--local-steps), N replicas, "
                           "the default outer step (SGD, Nesterov 0.9, lr 0.7); steps and warm-up in rounds (a quarter of "
                           "--steps, at least 6); a step's time is a round's",
            "cmemi_local_stream": f"cmemi_local streaming: train.fragments {args.fragments} (--fragments), as many inner "
                                  "steps in segments of H / F; a step's time is a segment's (workers compute a "
                                  "replica's next segment while parked, and get only the changed fragment)",
            "cmemi_local_int8_down": "cmemi_local with compression.codec int8 (each replica's change up) and "
                                     "compression.downlink int8 (a round starts from the mirror, whose change comes "
                                     "down in int8): about a quarter of cmemi_local's bytes both ways",
            "cmemi_local_rare": f"whole rounds with compression.codec int4 up, compression.downlink int4, one server "
                                f"(cluster.shards 1) and train.state_every {RARE_EVERY}: a replica's state up every "
                                f"{RARE_EVERY} rounds (issue 48, docs/design/local-steps.md)",
            "cmemi_local_rare_kn": "cmemi_local_rare at cluster.shards N (a shard on every worker host): the coded "
                                   "slices and the states spread over the N hosts' links",
            "cmemi_local_rare_every": "cmemi_local_rare (compression.downlink int4) with train.state_every 1 (a state "
                                      "every round), the same run's "
                                      "baseline for what D saves",
        },
        "bytes_note": "bytes_*_per_step count every shard's sockets (summary.json's bytes_sent/bytes_received)",
        "by_n": {},
    }
    t_start = time.monotonic()
    lab = None
    sampler = CpuSampler()
    try:
        lab = netns.NetLab(subnet="10.214.0")
        server = lab.host("srv", 2)
        hosts = [lab.host(f"h{i}", 10 + i) for i in range(max(ns_))]
        servers = ([lab.host(f"s{i}", 40 + i) for i in range(max(ns_))]
                   if any("dedicated" in s or "pipelined" in s for s in systems) else [])
        shaped = [server, *hosts, *servers]
        allow_congestion_control(args.tcp_cc)
        for h in shaped:
            congestion_control(h, args.tcp_cc)
        from cmemi.shared.wire.security import generate

        keys = work / "keys"
        generate(keys)
        cluster = Cluster(lab, server, hosts, work, sampler, start_redis(lab, server, work), keys, servers)
        cluster.patience = args.patience
        cluster.timeline = args.timeline
        for n in ns_:
            rate = rate_bit_s(rates[n])
            for h in shaped:
                lab.shape(h, rates[n], args.burst)
            probe = 8 * max(1, int(rate / 8 / 4))  # about a quarter of a second's worth
            link = {"rate": rates[n], "rate_bit_s": rate,
                    "probe_mbit_s": {f"{a.name}->{b.name}": round(probe_rate(a, b, probe), 1)
                                     for a, b in ((hosts[1], hosts[0]), (hosts[0], server))}}
            C.log(f"N = {n}: {len(shaped)} hosts shaped to {rates[n]}; probe {link['probe_mbit_s']} Mbit/s")
            runs: dict[str, Any] = {}
            for system in systems:
                C.log(f"N = {n}: {system} ({steps} steps)")
                first_error = None
                for _attempt in range(2):  # a gloo rank sometimes aborts in its rendezvous ("terminate called"): once more
                    try:
                        before = tbf_drops(lab, shaped)
                        runs[system] = run_system(cluster, system, n, steps, warmup, args.stages, args.local_steps,
                                                  args.fragments)
                        after = tbf_drops(lab, shaped)
                        runs[system]["link_drops"] = drops_between(before, after)
                    except Exception as exc:  # one failed system does not lose the others' figures
                        runs[system] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
                    if "error" not in runs[system] or first_error is not None:
                        break
                    first_error = runs[system]["error"]
                    C.log(f"N = {n}: {system} failed ({first_error.splitlines()[0][:200]}); once more")
                if first_error is not None:
                    runs[system]["first_attempt_error"] = first_error
                if system in LOCAL_SYSTEMS:
                    step_ms = SLEEP_MS + args.backward_ms
                    runs[system]["emulated_compute_bound_samples_per_s"] = emulated_compute_bound(n, step_ms)
                    runs[system]["of_emulated_compute_bound"] = of_bound(runs[system], emulated_compute_bound(n, step_ms))
                    frags = args.fragments if system.startswith("cmemi_local_stream") else 1
                    # SGD with momentum: a replica's inner state is as big as the parameters; int8 both ways: the
                    # changes' and the parameters' slices a quarter of them, int4 both ways (4 bits and an fp32 scale per
                    # 128) 17 / 128 of them (whole rounds: the states stay fp32)
                    slices = (pbytes // 4 if system == "cmemi_local_int8_down" else pbytes * 17 // 128
                              if system in RARE else pbytes)
                    runs[system]["placement_bounds_s"] = C.rnd(local_step_bounds_s(
                        n, slices, pbytes, rate, args.local_steps // frags * step_ms / 1000, frags), 4)
                    if args.compute_bound and "error" not in runs[system]:
                        C.log(f"N = {n}: {system} again, links at {args.bound_rate} (--compute-bound)")
                        bound = with_compute_bound(lab, shaped, args.bound_rate, rates[n], args.burst, functools.partial(
                            run_system, cluster, system, n, steps, warmup, args.stages, args.local_steps, args.fragments))
                        runs[system]["compute_bound"] = bound
                        runs[system]["of_measured_compute_bound"] = of_bound(runs[system], bound.get("samples_per_s"))
                if args.slow_host and "error" not in runs[system]:
                    slow_rate = f"{rate * args.slow_host / 1e3:.0f}kbit"
                    C.log(f"N = {n}: {system} again, host {hosts[n - 1].name} at {slow_rate} (--slow-host)")
                    slow = with_compute_bound(lab, [hosts[n - 1]], slow_rate, rates[n], args.burst, functools.partial(
                        run_system, cluster, system, n, steps, warmup, args.stages, args.local_steps, args.fragments))
                    runs[system]["slow_host"] = {"host": hosts[n - 1].name, "rate": slow_rate, **slow}
                    runs[system]["slow_host_vs_all_fast"] = of_bound(slow, runs[system].get("samples_per_s"))
                    runs[system]["slow_host_goal"] = round((n - 1 + args.slow_host) / n, 3)
                    if args.pace_off_too and system in LOCAL_SYSTEMS:
                        C.log(f"N = {n}: {system} again, host {hosts[n - 1].name} at {slow_rate}, pace_replicas off")
                        off = with_compute_bound(lab, [hosts[n - 1]], slow_rate, rates[n], args.burst, functools.partial(
                            run_system, cluster, system, n, steps, warmup, args.stages, args.local_steps, args.fragments,
                            False))
                        runs[system]["slow_host_pace_off"] = {"host": hosts[n - 1].name, "rate": slow_rate, **off}
                        runs[system]["slow_host_pace_off_vs_all_fast"] = of_bound(off, runs[system].get("samples_per_s"))
                C.log(f"N = {n}: {system} -> {runs[system].get('step_time_median_s', runs[system].get('error'))}")
                result["by_n"][str(n)] = {"link": link, **summarise(n, runs, pbytes, rate)}
        failed = [f"N={n} {k}" for n, x in result["by_n"].items() for k, r in x["runs"].items() if "error" in r]
        if failed:
            result["error"] = f"runs failed: {', '.join(failed)}"
    except BaseException as exc:
        C.record_error(result, exc)
        raise
    finally:
        sampler.close()
        if lab is not None:
            left = lab.close()
            if left:
                result["namespaces_left"] = left
        C.finish(result, work, args.keep, t_start)  # prints it, with the load average at the end
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if "error" in result:
        sys.exit(1)


if __name__ == "__main__":
    main()
