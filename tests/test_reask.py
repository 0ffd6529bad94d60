"""Re-asks are not losses (docs/design.md §2): the leader's bookkeeping of unanswered work
(services/aggregator/leader/leasing.py) and the worker's reading of `pending` (services/worker/links/patience.py), as pure
logic; tests/test_slow_link.py shows the whole exchange over a shaped link."""

from __future__ import annotations

import os

from cmemi.services.aggregator.common.admission import LeaseSeal, WorkerInfo
from cmemi.services.aggregator.common.misfits import CAP, LIMIT, Misfits
from cmemi.services.aggregator.leader.leasing import Leasing
from cmemi.services.worker.links.patience import Patience
from cmemi.shared.config.loading import load_config

from tests.conftest import DIGITS

W0, W1 = b"w0/1/1", b"w1/2/1"


def leasing() -> Leasing:
    return Leasing(load_config(DIGITS, []), False, False, LeaseSeal(os.urandom(32)), 1, lambda: 2)


def test_a_reask_while_work_is_unanswered_is_answered_pending_not_served() -> None:
    lz = leasing()
    info = WorkerInfo("w0", 1, "h")
    node = lz.lease(W0, info, -1)
    assert node is not None
    assert lz.sent(W0, 0) is False
    assert lz.answered(W0, 1) is False  # the work may be on its way: no release, no second parameter set
    assert lz.answered(W0, 2) is False
    assert lz.answered(W1, 1) is True  # another worker's re-ask: nothing of its own unanswered
    assert lz.answered(W0, None) is True  # a plain want (or a grad): the work was answered
    assert lz.answered(W0, 3) is True  # ... so a later re-ask is served as a want
    for hostile in (True, "1", 1.5, -1, 0):  # only a positive integer is a re-ask
        lz.sent(W0, None)
        assert lz.answered(W0, hostile) is True


def test_the_same_version_sent_twice_to_a_worker_is_counted() -> None:
    lz = leasing()
    assert lz.sent(W0, 0) is False
    assert lz.sent(W0, None) is False  # work without parameters
    assert lz.sent(W0, 1) is False
    assert lz.sent(W0, 1) is True  # the storm this prevents
    assert lz.sent(W1, 1) is False
    lz.forget(W0)
    assert lz.sent(W0, 1) is False and lz.answered(W1, 1) is False


def test_pending_means_lost_only_for_a_reask_sent_after_the_last_work() -> None:
    p = Patience(4.0)
    first = p.reask()  # asked again while the work was still arriving
    p.work_arrived()
    assert p.lost(first) is False  # the answer to it came behind the work: nothing was lost
    second = p.reask()  # asked again after the work (and our gradient) went out
    assert p.lost(second) is True  # the aggregator still waits: the work or the gradient was lost


def test_reasks_back_off_while_no_work_comes() -> None:
    p = Patience(4.0)
    t = p.last_heard
    assert p.due(t + 3.9) is None and p.due(t + 4.1) is not None
    waits = []
    for _ in range(6):
        p.reask()
        waits.append(next(s for s in range(1, 200) if p.due(p.last_heard + s) is not None))
    assert waits == [9, 17, 33, 65, 65, 65]  # 8, 16, 32, 64 s, then no longer (just over each)
    p.work_arrived()
    assert p.due(p.last_heard + 4.1) is not None


def test_misfits_count_a_workers_unfit_gradients_in_a_row_not_races() -> None:
    """services/aggregator/common/misfits.py: the LIMIT-th gradient in a row that does not fit is the reject; a taken one,
    or a race (stale, not leased, duplicate), does not count; the identities tracked are capped."""
    m = Misfits()
    assert [m.dropped(W0, "codec_bad_shape") for _ in range(LIMIT)] == [False] * (LIMIT - 1) + [True]
    for race in ("stale_step", "not_leased", "duplicate", "forged_lease", "shm_overwritten"):
        assert not m.dropped(W1, race)
    assert W1 not in m.runs
    for _ in range(LIMIT - 1):
        assert not m.dropped(W1, "bad_inner")
    m.forget(W1)  # a taken gradient
    assert not m.dropped(W1, "grad_names")  # the run starts over after a taken gradient
    for i in range(2 * CAP):
        m.dropped(f"w{i}".encode(), "bad_losses")
    assert len(m.runs) <= CAP
    w7 = b"w7/1/1"
    m = Misfits()
    reasons = [m.reject(w7, "w7", "codec_bad_shape", "w7: step 3", "the aggregator") for _ in range(LIMIT + 1)]
    assert reasons[:LIMIT - 1] == [None] * (LIMIT - 1) and reasons[LIMIT] is None  # (the count starts over)
    assert reasons[LIMIT - 1].startswith("the aggregator dropped 3 gradients in a row of worker w7 as codec_bad_shape")
