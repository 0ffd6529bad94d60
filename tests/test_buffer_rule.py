"""The buffer rule (shared/core/buffers.py) and the pieces around it, without processes."""

from __future__ import annotations

import random

import numpy as np
import torch
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.shared.core import buffers
from cmemi.shared.core.data import fingerprint, seed_microbatch
from cmemi.shared.core.environment import differences
from cmemi.shared.core.reduction import tree_reduce


def test_floating_buffers_are_the_tree_mean_and_counters_advance_by_M() -> None:
    M = 5
    bn = torch.nn.BatchNorm1d(3)
    live = buffers.travelling(bn)
    assert set(live) == {"running_mean", "running_var", "num_batches_tracked"}
    start = {n: b.clone() for n, b in live.items()}
    produced = []
    for m in range(M):
        with torch.no_grad():
            for n, b in live.items():
                b.copy_(start[n])
        bn(torch.randn(8, 3) * (m + 1))
        produced.append({n: b.clone() for n, b in live.items()})
    c = StepCollector(0, M)
    for _ in range(M):
        c.lease("w0", 1, now=0.0, timeout=10.0)
    for m in (3, 0, 4, 1, 2):  # any arrival order
        c.offer(m, {"g": torch.ones(1)}, 0.0, ("w0", 1), buffers.contribution(start, {n: t.clone() for n, t in produced[m].items()}))
    with torch.no_grad():  # the aggregator's model never runs forward: its buffers are the step's start
        for n, b in live.items():
            b.copy_(start[n])
    buffers.fold(live, c.buffer_sum(), M)
    want = tree_reduce([p["running_var"] for p in produced], lambda a, b: a + b) / M
    assert torch.equal(bn.running_var, want)
    assert int(bn.num_batches_tracked) == M  # as one process accumulating M microbatches


def test_a_model_without_buffers_has_nothing_to_travel() -> None:
    assert buffers.travelling(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())) == {}


def test_every_global_rng_is_seeded_per_microbatch() -> None:
    def draw() -> tuple[float, float, float]:
        return torch.rand(1).item(), float(np.random.rand()), random.random()

    seed_microbatch(7, 3, 1)
    a = draw()
    seed_microbatch(7, 3, 2)
    b = draw()
    seed_microbatch(7, 3, 1)
    assert draw() == a and a != b


def test_a_dataset_drawing_from_an_unseeded_generator_is_refused() -> None:
    rng = np.random.default_rng()

    class Unseeded(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int):
            return torch.tensor(rng.random()), torch.tensor(0)

    try:
        fingerprint(Unseeded())
    except RuntimeError as exc:
        assert "does not seed" in str(exc)
    else:
        raise AssertionError("an unseeded generator went unnoticed")


def test_environment_differences_are_named() -> None:
    want = {"torch": "2.1", "threads": "1", "cpu": "AVX2"}
    assert differences(dict(want), want, tuple(want)) == []
    diff = differences({**want, "cpu": "AVX512"}, want, tuple(want))
    assert diff == ["cpu AVX512 (expected AVX2)"]
    assert differences(None, want, tuple(want))[0].startswith("no environment")


def test_signatures_of_user_functions_are_checked_at_start() -> None:
    import pytest
    from cmemi.shared.config.checks import ConfigError
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.plugins import check_plugins

    from tests.conftest import DIGITS

    with pytest.raises(ConfigError, match=r"eval_two_args\(model, dataset\).*fixtures.py.*evaluate\(model\)"):
        check_plugins(load_config(DIGITS, ["eval.fn=tests.helpers.fixtures:eval_two_args"]))
    with pytest.raises(ConfigError, match="train.loss"):
        check_plugins(load_config(DIGITS, ["train.loss=tests.helpers.fixtures:constant_eval"]))  # takes 1, called with 2


def test_the_step_0_evaluation_reports_a_broken_eval_fn_in_one_line() -> None:
    from cmemi.services.aggregator.common.evaluation import Probe
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.plugins import build_model

    from tests.conftest import DIGITS
    from tests.helpers.fixtures import constant_eval, raising_eval

    cfg = load_config(DIGITS)
    state = build_model(cfg).state_dict()
    bad = Probe(cfg, raising_eval, state)
    assert bad.done.wait(60)
    assert bad.error is not None and "KeyError" in bad.error and "raising_eval" in bad.error and "fixtures.py" in bad.error
    good = Probe(cfg, constant_eval, state)
    assert good.done.wait(60) and good.error is None


def test_a_worker_with_another_environment_is_refused_or_admitted_with_a_warning() -> None:
    """Admission (the leader's and every shard's): refused with one line naming what differs, counted, or
    admitted with a warning under cluster.require_same_environment: false."""
    from types import SimpleNamespace

    from cmemi.services.aggregator.common.admission import Admission, EnvironmentCheck
    from cmemi.shared.coordination.keys import Keys

    sent: list[dict] = []
    warned: list[str] = []
    dropped: list[str] = []
    own = {"torch": "2.13.0", "threads": "1", "cpu": "AVX2"}
    registry = SimpleNamespace(hget=lambda key, field: "1", get=lambda key: None)  # every incarnation 1, no fence
    for require in (True, False):
        admission = Admission(registry, Keys("run"), lambda fp: True, EnvironmentCheck(own), require,
                              lambda ident, mtype, **f: sent.append({"type": mtype, **f}),
                              lambda reason, detail: dropped.append(reason),
                              SimpleNamespace(warning=lambda msg, **f: warned.append(f["detail"])))
        same = {**own, "device": "cpu", "gpu": ""}
        assert admission.hello(b"a", {"wid": "w0", "inc": 1, "host": "h", "fp": {}, "env": same}) is not None
        other = {**same, "cpu": "AVX512"}
        admitted = admission.hello(b"b", {"wid": "w1", "inc": 1, "host": "h2", "fp": {}, "env": other})
        assert (admitted is not None) is not require and admission.admitted(b"b") is not require
    assert len(sent) == 1 and sent[0]["fatal"] and "cpu AVX512 (expected AVX2)" in sent[0]["reason"]
    assert "require_same_environment: false" in sent[0]["reason"] and "worker w1 on host h2" in sent[0]["reason"]
    assert len(warned) == 1 and "cpu AVX512" in warned[0]
    assert dropped == ["wrong_environment"]


def test_user_code_failing_twice_the_same_way_is_fatal_and_once_is_retried() -> None:
    from types import SimpleNamespace

    import pytest
    from cmemi.services.worker.compute.block import BlockComputer
    from cmemi.services.worker.compute.microbatch import UserCodeError

    def worker(errors: list[Exception | None]) -> BlockComputer:
        def run(step: int, m: int, scale: float):
            e = errors.pop(0)
            if e is None:
                return 1.0, {}, None
            try:
                raise e
            except Exception as exc:
                raise UserCodeError("forward pass", exc) from exc

        def fatal(message: str):
            raise SystemExit(message)

        return BlockComputer(SimpleNamespace(), SimpleNamespace(run=run, params={}),
                             SimpleNamespace(warning=lambda *a, **k: None), fatal, lambda: "w0")

    assert worker([OSError("flaky read"), None]).one(0, 0) == (1.0, {}, None)  # transient: goes on
    with pytest.raises(SystemExit, match=r"ValueError: boom \(raised in run, .*test_buffer_rule.py:\d+\) during "
                                         "forward pass, the same way twice on worker w0"):
        worker([ValueError("boom"), ValueError("boom")]).one(0, 0)
    with pytest.raises(UserCodeError):  # failing differently: not known to be deterministic, the process restarts
        worker([ValueError("boom"), ValueError("other")]).one(0, 0)


def test_the_aggregator_refuses_buffers_that_do_not_fit_or_are_not_finite() -> None:
    from cmemi.services.aggregator.common.trainer import Trainer
    from cmemi.shared.config.loading import load_config

    from tests.conftest import ROOT

    t = Trainer(load_config(str(ROOT / "examples" / "resnet.yaml")))
    good = {n: b.clone() for n, b in t.buffers.items()}
    assert t.contribution({n: b.clone() for n, b in good.items()}) is not None
    assert t.contribution({**good, "1.running_var": torch.full_like(good["1.running_var"], float("nan"))}) is None
    assert t.contribution({k: v for k, v in good.items() if k != "1.running_mean"}) is None
    assert t.contribution({**good, "1.running_mean": torch.zeros(3)}) is None
    assert t.wire_state().keys() >= {"buffer:1.running_mean"}  # buffers go out with the parameters
    before = t.params_sha256()
    t.buffers["1.running_mean"].add_(1.0)
    assert t.params_sha256() != before  # and are part of the result's hash


def test_frozen_buffers_stay_initial_and_mean_buffers_train() -> None:
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.plugins import build_model

    from cmemi.commands.reference import train
    from tests.conftest import ROOT

    config, sets = str(ROOT / "examples" / "resnet.yaml"), ["train.steps=2", "eval.fn=null"]
    initial = build_model(load_config(config, sets)).state_dict()
    frozen, _ = train(load_config(config, [*sets, "model.buffers=frozen"]))
    mean, _ = train(load_config(config, sets))
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(frozen.model.state_dict()[name], initial[name])
        assert not torch.equal(mean.model.state_dict()[name], initial[name])
    assert int(mean.model.state_dict()["1.num_batches_tracked"]) == 2 * 4
