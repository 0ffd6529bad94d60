"""Experiment trackers, fast and in-process: the config field's checks, the missing-package line (through the real
`cmemi up`, exit 2 before any service starts), and the writer's promises with test-only trackers — calls on the
tracker's own thread, a full queue dropped and counted, a raising tracker disabled, a hanging one abandoned."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog
from cmemi.services.aggregator.leader.trackers import registry
from cmemi.services.aggregator.leader.trackers.base import hyperparameters, scalars_of
from cmemi.services.aggregator.leader.trackers.writer import TrackerWriter
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.extras import MissingExtra
from cmemi.shared.config.loading import load_config

from tests.conftest import DIGITS, ROOT
from tests.helpers.trackers import Blocking, Raising, Recording


def cfg(*sets: str):
    return load_config(DIGITS, list(sets))


def test_loggers_default_empty_and_checked() -> None:
    assert cfg().metrics.loggers == []
    assert cfg("metrics.loggers=[tensorboard, mlflow, wandb]").metrics.loggers == ["tensorboard", "mlflow", "wandb"]
    with pytest.raises(ConfigError, match=r"'metrics.loggers'.*'tensorbord' is not a tracker \(did you mean "
                                          r"'tensorboard'\?\); use any of tensorboard, mlflow, wandb"):
        cfg("metrics.loggers=[tensorbord]")
    with pytest.raises(ConfigError, match="names a tracker twice"):
        cfg("metrics.loggers=[wandb, wandb]")
    with pytest.raises(ConfigError, match="metrics.logger_queue"):
        cfg("metrics.logger_queue=0")
    with pytest.raises(ConfigError, match="metrics.logger_timeout"):
        cfg("metrics.logger_timeout=0")


def test_missing_package_names_the_field_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else found(name, *a))
    with pytest.raises(MissingExtra) as err:
        registry.check(cfg("metrics.loggers=[tensorboard, mlflow]"))
    assert str(err.value) == ("config field 'metrics.loggers' names 'mlflow', which needs the Python package "
                              "'mlflow': pip install 'cmemi[mlflow]'")
    with pytest.raises(ConfigError, match="is not a Tracker class"):
        registry.check(cfg("metrics.loggers=['tests.helpers.trackers:NEVER.is_set']"))
    registry.check(cfg("metrics.loggers=[tensorboard, 'tests.helpers.trackers:Blocking']"))


def test_cmemi_up_refuses_a_missing_tracker_package_before_any_service_starts(tmp_path: Path) -> None:
    """The real CLI, with wandb's package hidden from it: one line, exit 2, and no service ever ran."""
    hide = ("import importlib.util as u, sys; found = u.find_spec; "
            "u.find_spec = lambda n, *a: None if n == 'wandb' else found(n, *a); "
            "from cmemi.cli import main; sys.argv = ['cmemi', *sys.argv[1:]]; main()")
    r = subprocess.run([sys.executable, "-c", hide, "up", DIGITS, "--set", f"run.dir={tmp_path / 'run'}",
                        "--set", "metrics.loggers=[wandb]"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["cmemi: error: config field 'metrics.loggers' names 'wandb', which needs "
                                             "the Python package 'wandb': pip install 'cmemi[wandb]'"], r.stderr
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "cluster.json").exists()


def test_config_as_flat_hyperparameters_and_lines_as_scalars() -> None:
    params = hyperparameters(cfg("train.steps=7"))
    assert params["train.steps"] == 7 and params["model.kwargs.hidden"] == 128 and params["run.dir"] == "null"
    assert all(isinstance(v, (str, int, float, bool)) for v in params.values())
    assert scalars_of({"step": 3, "loss": 0.5, "lr": 0.1, "skipped": True, "samples_per_s": None, "t": 1.0}) == \
        {"loss": 0.5, "lr": 0.1, "skipped": 1.0}
    assert scalars_of({"step": 20, "eval": {"accuracy": 0.9, "note": "x"}, "t": 2.0}) == {"eval/accuracy": 0.9}


def writer(tracker, tmp_path: Path, *sets: str) -> TrackerWriter:
    return TrackerWriter(tracker, tmp_path, cfg(*sets), {"train.steps": 3}, structlog.get_logger("test"))


def test_every_call_is_made_on_the_trackers_own_thread_in_order(tmp_path: Path) -> None:
    rec = Recording()
    rec.name = "rec"
    w = writer(rec, tmp_path)
    for step in (1, 2, 3):
        w.put("scalars", step, {"loss": 1.0 / step}, time.time())
    w.put("event", 3, "died", "{}", 1, "1700000000000-0")
    assert w.finish(time.monotonic() + 30) and w.dropped == 0 and w.failed is None
    assert rec.calls == [("open", {"train.steps": 3}), ("scalars", 1, {"loss": 1.0}), ("scalars", 2, {"loss": 0.5}),
                         ("scalars", 3, {"loss": 1 / 3}), ("event", 3, "died", 1), ("close",)]
    assert rec.threads == {"tracker-rec"}
    assert w.where == "recorded"


def test_a_restarted_leaders_tracker_skips_what_it_wrote_before_and_writes_the_rest(tmp_path: Path) -> None:
    """A successor's writer on the same run directory is handed everything again (hub.py's replay, events from the
    stream's start): it writes only what its tracker had not written (written.py), each line and event once."""
    first = Recording()
    first.name = "rec"
    w = writer(first, tmp_path)
    for step in (1, 2):
        w.put("scalars", step, {"loss": 1.0 / step}, time.time())
    w.put("scalars", 2, {"eval/accuracy": 0.5}, time.time())
    w.put("event", 2, "died", "{}", 1, "1700000000000-0")
    assert w.finish(time.monotonic() + 30)
    again = Recording()
    again.name = "rec"
    w = writer(again, tmp_path)
    for step in (1, 2, 3):
        w.put("scalars", step, {"loss": 1.0 / step}, time.time())
    w.put("scalars", 2, {"eval/accuracy": 0.5}, time.time())
    w.put("scalars", 3, {"eval/accuracy": 0.75}, time.time())
    w.put("event", 2, "died", "{}", 1, "1700000000000-0")
    w.put("event", 3, "restarted", "{}", 1, "1700000000000-1")
    assert w.finish(time.monotonic() + 30)
    assert again.calls[1:] == [("scalars", 3, {"loss": 1 / 3}), ("scalars", 3, {"eval/accuracy": 0.75}),
                               ("event", 3, "restarted", 1), ("close",)]


def test_a_blocking_tracker_never_blocks_the_caller_and_is_abandoned(tmp_path: Path) -> None:
    blocking = Blocking()
    w = writer(blocking, tmp_path, "metrics.logger_queue=4")
    t0 = time.monotonic()
    for step in range(1, 1001):
        w.put("scalars", step, {"loss": 1.0}, 0.0)
    put_s = time.monotonic() - t0
    assert put_s < 1.0, put_s  # a thousand puts against a stuck tracker: no wait among them
    # one record taken (it blocks on it), four queued, the rest dropped and counted
    assert 1000 - 5 <= w.dropped <= 1000 - 4, w.dropped
    t0 = time.monotonic()
    assert not w.finish(time.monotonic() + 0.3)  # abandoned after the bounded wait
    assert time.monotonic() - t0 < 5
    assert w.where == str(tmp_path / "blocking") and w.thread.daemon


def test_a_raising_tracker_is_disabled_with_one_warning(tmp_path: Path) -> None:
    raising = Raising()
    raising.name = "raising"
    warnings: list[dict] = []
    log = structlog.wrap_logger(None, processors=[lambda _l, _m, event: warnings.append(event) or ""],
                                wrapper_class=structlog.stdlib.BoundLogger)
    w = TrackerWriter(raising, tmp_path, cfg(), {}, log)
    w.put("scalars", 1, {"loss": 1.0}, 0.0)
    assert w.finish(time.monotonic() + 30)
    assert w.failed == "RuntimeError: injected tracker failure"
    disabled = [e for e in warnings if "disabled" in e["event"]]
    assert [e["tracker"] for e in disabled] == ["raising"] and disabled[0]["error"] == w.failed
    w.put("scalars", 2, {"loss": 1.0}, 0.0)  # ignored from now on, not counted as dropped
    assert w.dropped == 0


def test_the_leaders_side_never_waits_on_the_trackers_process(redis_server, tmp_path: Path) -> None:
    """The hub against its real child process and a real Redis, with a tracker that blocks forever: a thousand
    lines go without a wait, and close() comes back within its bound with the blocking tracker abandoned."""
    from types import SimpleNamespace

    from cmemi.services.aggregator.leader.trackers.hub import Trackers
    from cmemi.shared.coordination.keys import Keys
    from cmemi.shared.coordination.membership import connect, emit

    config = cfg(f"run.dir={tmp_path}", "metrics.loggers=['tests.helpers.trackers:Blocking']", "metrics.logger_queue=16")
    client, keys = connect(redis_server.url), Keys("hub")
    emit(client, keys, "died", role="worker", id="w0")
    ctx = SimpleNamespace(cfg=config, redis=client, keys=keys, run_dir=tmp_path, log=structlog.get_logger("test"),
                          fatal=pytest.fail)
    hub = Trackers(ctx)  # type: ignore[arg-type]
    t0 = time.monotonic()
    for step in range(1, 1001):
        hub.line({"step": step, "loss": 1.0, "t": 0.0})
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    s = hub.close(0.5)
    assert time.monotonic() - t0 < 10
    name = "tests.helpers.trackers:Blocking"
    assert s["trackers"] == {name: str(tmp_path / "blocking")} and s["trackers_abandoned"] == [name]
    assert s["trackers_dropped"][name] > 0 and s["trackers_failed"] == {}
    assert hub.proc.returncode is not None  # the process is gone
    assert hub.close(0.5) is s  # once
