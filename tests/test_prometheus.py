"""A real Prometheus (Debian's `prometheus`, installed by scripts/system_packages.sh) scraping a real run through
the target file `cmemi up` keeps (RUN_DIR/prometheus/targets.json, file_sd): the run's step, loss and per-worker
series come back from its HTTP API, every query of the shipped Grafana dashboard (docker/grafana/cmemi.json)
answers, and a SIGKILLed worker's target goes down and its replacement's comes up."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers.chaos import Cluster, poll

pytestmark = [pytest.mark.integration, pytest.mark.fault]

SETS = ("train.steps=3000", "scheduler.kwargs.T_max=3000", "cluster.spare_workers=0", "checkpoint.every_steps=0",
        "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1", "metrics.enabled=true",
        "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.01}")


def free_port() -> int:
    """Prometheus takes no port 0 it would tell us about: a port the kernel just handed out, free again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, targets: Path, work: Path) -> None:
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        assert Path(binary).is_file(), ("Debian's prometheus is not installed: run scripts/system_packages.sh "
                                        "(`make test` does) or apt-get install -y prometheus")
        (work / "data").mkdir(parents=True)
        (work / "prometheus.yml").write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "cmemi", "file_sd_configs": [{"files": [str(targets)],
                                                                           "refresh_interval": "1s"}]}]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(work / "prometheus.log", "w")
        self.proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={work / 'data'}",
                                      f"--web.listen-address={self.url.removeprefix('http://')}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        poll(lambda: self.ready(), 60, "prometheus ready")

    def ready(self) -> bool:
        assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        body = json.loads(urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path / "run", *SETS)
    try:
        yield c
    finally:
        c.close()


def worker_targets(prom: Prometheus, wid: str) -> list[dict[str, Any]]:
    return [t for t in prom.targets() if t["labels"].get("worker") == wid]


def test_prometheus_scrapes_the_run_and_follows_a_replaced_worker(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    targets = c.run_dir / "prometheus" / "targets.json"
    roles = {"aggregator", "checkpointer", "coordinator", "worker"}

    def listed() -> list[dict[str, Any]] | None:
        groups = json.loads(targets.read_text()) if targets.is_file() else []
        return groups if {g["labels"]["role"] for g in groups} == roles and len(groups) == 5 else None

    groups = poll(listed, 120, "targets.json with every service")
    assert all(len(g["targets"]) == 1 and g["targets"][0].startswith("127.0.0.1:") for g in groups)
    assert {g["labels"]["worker"] for g in groups if g["labels"]["role"] == "worker"} == {"w0", "w1"}
    prom = Prometheus(targets, tmp_path / "prometheus")
    try:
        poll(lambda: len(prom.targets()) == 5 and all(t["health"] == "up" for t in prom.targets()), 60,
             "five targets up")
        # the run's step, loss and per-worker series, as Prometheus scraped them
        step = poll(lambda: prom.query('cmemi_step{job="cmemi",role="aggregator"}'), 30, "cmemi_step")
        assert step[0]["metric"]["role"] == "aggregator" and float(step[0]["value"][1]) >= 1
        assert poll(lambda: prom.query('cmemi_loss{job="cmemi",role="aggregator"}'), 30, "cmemi_loss")
        accepted = 'cmemi_accepted_microbatches_total{job="cmemi",role="aggregator"}'
        per_worker = poll(lambda: len(r := prom.query(accepted)) == 2 and r, 30, "both workers' accepted microbatches")
        assert {r["metric"]["worker"] for r in per_worker} == {"w0", "w1"}
        # every query of the Grafana dashboard answers on these metric names
        dashboard = json.loads((ROOT / "docker" / "grafana" / "cmemi.json").read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        quiet = ("cmemi_deaths_total", "cmemi_restarts_total", "cmemi_checkpoint_stall")  # nothing died yet
        for expr in exprs:
            if not any(q in expr for q in quiet):
                poll(lambda e=expr: prom.query(e), 30, f"dashboard query {expr}")

        # a worker SIGKILLed: its target goes down, then its replacement's (another port) comes up
        (old,) = worker_targets(prom, "w0")
        inc = c.signal("worker", "w0")
        poll(lambda: any(t["scrapeUrl"] == old["scrapeUrl"] and t["health"] == "down"
                         for t in worker_targets(prom, "w0")), 30, "the killed worker's target down")
        c.replaced("worker", "w0", inc)

        def replacement() -> bool:
            return any(t["scrapeUrl"] != old["scrapeUrl"] and t["health"] == "up" and
                       int(t["labels"]["incarnation"]) > inc for t in worker_targets(prom, "w0"))

        poll(replacement, 60, "the replacement's target up")
        poll(lambda: not any(t["scrapeUrl"] == old["scrapeUrl"] for t in worker_targets(prom, "w0")), 30,
             "the killed worker's target gone")
        deaths = poll(lambda: prom.query('cmemi_deaths_total{role="coordinator",exported_role="worker"}'), 30,
                      "cmemi_deaths_total")
        assert float(deaths[0]["value"][1]) >= 1
        assert c.proc.poll() is None, c.output()  # the run went on throughout
    finally:
        prom.close()
