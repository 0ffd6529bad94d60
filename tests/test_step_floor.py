"""Issue 45's small-step floor: what the leader does once a step, per tensor, dispatches one torch call for all of a
step's tensors (a dispatch costs microseconds, and cnn1d's step is ~1 ms of the leader's CPU), with the same bits as
the call per tensor it replaced; and the debug timing lines cost nothing when debug is off.

The op counts come from a TorchDispatchMode: a foreach op is one dispatch however many tensors it takes."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import structlog
import torch
from cmemi.services.aggregator.common.collector import StepCollector
from cmemi.services.aggregator.common.gradients import Spares
from cmemi.services.aggregator.steplog.staging import Staging
from cmemi.shared.compression.base import all_finite, finite
from cmemi.shared.core.reduction import add_into
from cmemi.shared.runtime.log import debug_enabled
from cmemi.shared.wire.layout import Layout
from torch.utils._python_dispatch import TorchDispatchMode

SHAPES = {"c1.w": (16, 1, 5), "c1.b": (16,), "c2.w": (32, 16, 5), "c2.b": (32,), "fc.w": (10, 32), "fc.b": (10,)}


class Ops(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (by name, overload dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def grads(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def test_finite_tests_the_sum_as_a_number_not_with_isfinite() -> None:
    t = torch.randn(1000)
    with Ops() as ops:
        assert finite(t)
    # the sum, read as a number: no isfinite (composite: an eq, an abs, a ne and an and, ~16 us for a 0-d tensor)
    assert set(ops.seen) == {"sum", "_local_scalar_dense"}, ops.seen
    assert not finite(torch.tensor([1.0, float("nan")])) and not finite(torch.tensor([float("-inf"), 1.0]))
    assert not finite(torch.full((4,), 3e38))  # the sum overflows fp32: not finite, as before (all_finite decides)
    assert finite(torch.empty(0)) and finite(torch.ones(3, dtype=torch.float16))
    assert all_finite([torch.full((4,), 3e38)]) and not all_finite([torch.ones(2), torch.tensor([float("nan")])])


def collected(m: int) -> StepCollector:
    c = StepCollector(0, m)
    for _ in range(m):
        c.lease("a", 1, now=0, timeout=10)
    for k in range(m):
        assert c.offer(k, grads(k, 10.0 ** (k % 3)), float(k), holder=("a", 1)) is None
    return c


def test_the_mean_divides_every_tensor_in_one_call_with_the_same_bits(monkeypatch: Any) -> None:
    for m in (2, 3, 4, 7):
        collected(m).mean()  # (the divisor's 0-d tensor is made once per M)
        with Ops() as ops:
            mean, _ = collected(m).mean()
        assert mean is not None
        assert ops.seen["_foreach_div_"] == 1 and "div_" not in ops.seen, ops.seen
        with monkeypatch.context() as patch:  # what the mean was before: a division by the number, tensor by tensor
            patch.setattr(torch, "_foreach_div_", lambda ts, d: [t.div_(int(d)) for t in ts])
            before, _ = collected(m).mean()
        assert before is not None and all(torch.equal(mean[n], before[n]) for n in SHAPES)


def test_add_into_adds_every_tensor_in_one_call_with_the_same_bits() -> None:
    a, b = grads(1), grads(2, 1e3)
    expected = {n: a[n].clone().add_(b[n]) for n in SHAPES}
    with Ops() as ops:
        out = add_into(a, b)
    assert out is a and ops.seen == Counter({"_foreach_add_": 1}), ops.seen
    assert all(torch.equal(a[n], expected[n]) for n in SHAPES)
    assert add_into({}, b) is b and add_into(a, {}) is a  # an overflowed microbatch adds nothing


def test_a_borrowed_gradient_is_owned_with_one_copy() -> None:
    spares, src = Spares(1 << 30), grads(3)
    with Ops() as ops:
        out = spares.own(src)
    assert ops.seen["_foreach_copy_"] == 1 and "copy_" not in ops.seen, ops.seen
    assert all(torch.equal(out[n], src[n]) and out[n].data_ptr() != src[n].data_ptr() for n in SHAPES)


def test_a_step_log_entry_is_staged_with_one_copy(tmp_path: Any) -> None:
    staging = Staging(f"floor{tmp_path.name[-6:]}", 0, checksum=False)
    try:
        src = {f"g.{n}": t for n, t in grads(4).items()}
        with Ops() as ops:
            views = staging.copy(src, local=True)
        assert ops.seen["_foreach_copy_"] == 1 and "copy_" not in ops.seen, ops.seen
        assert staging.desc is not None and all(torch.equal(views[n], src[n]) for n in src)
        kept = staging.copy(src, local=False)  # (a checkpointer elsewhere: the kept buffers, as before)
        assert all(torch.equal(kept[n], src[n]) for n in src)
    finally:
        staging.close()


def test_debug_enabled_follows_the_level_and_takes_a_fake_as_debug() -> None:
    info = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    debug = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    assert not debug_enabled(info) and debug_enabled(debug)
    assert debug_enabled(object())  # a test's fake logger: its debug lines are still called


def test_a_flat_layout_packs_every_tensor_with_one_copy() -> None:
    src = grads(5)
    layout = Layout(src)
    out = layout.pack(src)  # (fresh buffers: the padding zeroed once, outside the count)
    with Ops() as ops:
        again = layout.pack(src, out)
    assert ops.seen["_foreach_copy_"] == 1 and "copy_" not in ops.seen, ops.seen
    assert all(torch.equal(v, src[n]) for n, v in layout.views(again).items())


def test_spares_given_back_look_up_no_storage_when_the_sums_are_the_lent_tensors(monkeypatch: Any) -> None:
    looked: list[int] = []
    real = torch.Tensor.untyped_storage

    def counted(t: torch.Tensor) -> Any:
        looked.append(1)
        return real(t)

    monkeypatch.setattr(torch.Tensor, "untyped_storage", counted)
    spares = Spares(1 << 30)
    owned = spares.own(grads(6))
    spares.give_back(list(owned.values()))  # after each gradient: the step's partial sums are these very tensors
    assert looked == [] and len(spares.lent) == len(SHAPES)
    spares.give_back([owned["c2.w"][1:3]])  # a view shares its buffer's storage: that one stays lent, the rest go
    assert [t is owned["c2.w"] for _, t in spares.lent] == [True] and looked
    spares.reclaim()  # the step is over: everything is free again, kept for the next step
    assert spares.lent == [] and spares.lent_bytes == 0


def test_the_one_call_copies_take_an_empty_step(tmp_path: Any) -> None:
    """A foreach call refuses an empty list: an overflowed microbatch's gradient ({}), a skipped step's entry with no
    buffers, a layout of nothing (test_compression's fp16 overflow run restarted its leader on this)."""
    assert Spares(1 << 30).own({}) == {}
    assert add_into({}, {}) == {}
    assert Layout({}).pack({}) == {}
    staging = Staging(f"floor{tmp_path.name[-6:]}", 0, checksum=False)
    try:
        assert staging.copy({}, local=True) == {} and staging.copy({}, local=False) == {}
    finally:
        staging.close()
