"""`train.state_every` (D, issue 48: "states snapshotted rarely"): a replica's state goes up to its server after
rounds t with (t + r) mod D = 0 (and round 0), not every round; docs/design/local-steps.md, "Snapshotted every D
rounds". Units: the config field, the due rule that the worker sends by and every server takes by, the servers'
history of versions a replay needs (services/aggregator/common/history.py) and the worker's replay of rounds s … t − 1
(`LocalRound.catch_up`), bitwise equal to computing them in one go.
"""

from __future__ import annotations

import pytest
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import load_config
from cmemi.shared.core import fragments, innerstate

from tests.conftest import DIGITS

WHOLE = ("train.local_steps=5", "train.replicas=4", "train.steps=60")


def test_state_every_defaults_to_every_round_and_refuses_what_it_cannot_keep_exact() -> None:
    assert load_config(DIGITS, list(WHOLE)).train.state_every == 1
    for sets, why in [(("train.state_every=0",), "must be >= 1"),
                      (("train.steps=300", "train.state_every=4"), "train.local_steps is 0"),
                      (("train.local_steps=6", "train.fragments=3", "train.steps=60", "train.state_every=4"),
                       "streaming sends"),
                      ((*WHOLE, "train.state_every=4"), "does not do yet")]:
        with pytest.raises(ConfigError, match=f"config field 'train.state_every' = .*{why}.*; (use|set)") as err:
            load_config(DIGITS, ["train.steps=300", *sets] if "train.steps=60" not in sets else list(sets))
        assert "\n" not in str(err.value)  # one line, naming the field and the fix


def test_the_due_rule_ships_round_zero_then_every_d_rounds_staggered_by_replica() -> None:
    D, R, T = 4, 4, 16
    for r in range(R):
        shipped = [t for t in range(T) if innerstate.due(t, r, D)]
        assert shipped[0] == 0 and all((t + r) % D == 0 for t in shipped[1:])
        assert all(b - a <= D for a, b in zip(shipped, shipped[1:], strict=False))  # never more than D rounds apart
    # staggered: each round after the first ships about R / D states, not all R every D rounds
    assert all(sum(innerstate.due(t, r, D) for r in range(R)) == R // D for t in range(1, T))
    # D = 1 is the rule before issue 48: every round ships every replica's state
    assert all(innerstate.due(t, r, 1) for t in range(T) for r in range(R))


def test_a_snapshot_is_at_most_d_minus_one_rounds_behind_and_current_at_d_equal_one() -> None:
    D = 4
    for r in range(5):
        for t in range(20):
            s = innerstate.snapshot_start(t, r, D)
            assert 0 <= t - s <= D - 1, (r, t, s)
            assert s == 0 or innerstate.due(s - 1, r, D)  # the round before it shipped the state
            assert not any(innerstate.due(u, r, D) for u in range(s, t))  # and none since
        assert [innerstate.snapshot_start(t, r, 1) for t in range(6)] == list(range(6))


def test_streaming_keeps_its_own_rule() -> None:
    """The whole-rounds rule is not streaming's: a streaming run's snapshots stay `fragments.ships_state`'s."""
    assert [s for s in range(8) if fragments.ships_state(s, 3, 1)] == [0, 1, 4, 7]
