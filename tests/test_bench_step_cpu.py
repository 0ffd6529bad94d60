"""bench/step_cpu.py's pure parts: a --tree spec into a checkout and config values, and CPU samples into
milliseconds per step by role and thread (both workers summed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import step_cpu


def test_a_tree_spec_names_a_checkout_and_typed_config_values() -> None:
    root = Path(__file__).resolve().parent.parent
    t = step_cpu.parse_tree(f"nolog={root},checkpoint.step_log=false,train.log_every=5")
    assert t == {"name": "nolog", "path": str(root), "set": {"checkpoint": {"step_log": False},
                                                              "train": {"log_every": 5}}}
    cfg = step_cpu.config("x", root / "run", 100, t["set"])
    assert cfg["checkpoint"] == {"every_steps": 0, "step_log": False} and cfg["train"]["log_every"] == 5
    assert cfg["train"]["steps"] == 100 and cfg["cluster"]["workers"] == 2


@pytest.mark.parametrize("spec, says", [("head", "NAME=PATH"), ("head=/nonexistent", ".venv/bin/python"),
                                        ("head=.,step_log=false", "SECTION.KEY=VALUE")])
def test_a_bad_tree_spec_says_what_is_expected(spec: str, says: str) -> None:
    with pytest.raises(SystemExit, match=says.replace(".", r"\.")):
        step_cpu.parse_tree(spec)


def test_cpu_per_step_by_role_and_thread() -> None:
    labels = {1: "aggregator", 2: "worker:w0", 3: "worker:w1"}
    first = {1: {"main#1": 1.0, "ZMQbg/IO/0#11": 0.5}, 2: {"main#2": 2.0}, 3: {"main#3": 3.0}}
    last = {1: {"main#1": 1.1, "ZMQbg/IO/0#11": 0.51, "python#12": 0.02}, 2: {"main#2": 2.3}, 3: {"main#3": 3.3}}
    by_role, by_thread = step_cpu.per_step(first, last, labels, 100)
    assert by_role == {"aggregator": pytest.approx(1.3), "worker": pytest.approx(6.0)}
    assert by_thread == {"aggregator/ZMQbg/IO/0": pytest.approx(0.1), "aggregator/main": pytest.approx(1.0),
                         "aggregator/python": pytest.approx(0.2), "worker/main": pytest.approx(6.0)}


def test_this_process_threads_are_read() -> None:
    threads = step_cpu.thread_cpu(os.getpid())
    assert threads[f"main#{os.getpid()}"] > 0
