"""Streaming DiLoCo's fragments (shared/core/fragments.py): contiguous runs of the grid's pieces with about equal bytes,
the step that syncs each, the segment that merges it, and the merge."""

from __future__ import annotations

import pytest
import torch
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.core import fragments
from cmemi.shared.core.grid import Piece


def pieces(*sizes: int) -> list[Piece]:
    return [Piece(f"p{i}", f"p{i}", 0, 1, n) for i, n in enumerate(sizes)]


def test_split_is_contiguous_balanced_and_never_empty() -> None:
    assert fragments.split(pieces(4, 4, 4, 4), 2) == [["p0", "p1"], ["p2", "p3"]]
    assert fragments.split(pieces(10, 1, 1, 1), 2) == [["p0"], ["p1", "p2", "p3"]]
    assert fragments.split(pieces(1, 1, 1, 10), 3) == [["p0", "p1"], ["p2"], ["p3"]]  # the last needs one
    assert fragments.split(pieces(5, 5, 5), 3) == [["p0"], ["p1"], ["p2"]]
    out = fragments.split(pieces(*range(1, 40)), 7)
    assert [n for f in out for n in f] == [f"p{i}" for i in range(39)] and all(out)


def test_more_fragments_than_pieces_is_refused() -> None:
    with pytest.raises(ConfigError, match="'train.fragments' = 3: .*use at most 2 fragments"):
        fragments.split(pieces(1, 1), 3)


def test_schedule() -> None:
    assert [fragments.synced(s, 3) for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [fragments.merged(s, 3) for s in range(7)] == [None, None, 0, 1, 2, 0, 1]


def test_merge() -> None:
    local = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([5.0])}
    outer = {"a": torch.tensor([3.0, 6.0]), "b": torch.tensor([7.0])}
    fragments.merge(local, outer, ["a"], 0.5)
    assert local["a"].tolist() == [2.0, 4.0] and local["b"].tolist() == [5.0]
    fragments.merge(local, outer, ["b"], 0.0)
    assert local["b"].tolist() == [7.0]


def test_changed_since_names_the_fragments_synced_since_or_nothing() -> None:
    """Version v differs from v − 1 in fragment (v − 1) mod F alone: a worker at one of the F − 1 versions before gets
    the union; at none (-1), the current one, F or more back, or with whole rounds: None (the whole version)."""
    frags = [["a"], ["b", "c"], ["d"]]
    assert fragments.changed(4, 5, frags) == {"b", "c"}  # step 4 synced fragment 1
    assert fragments.changed(3, 5, frags) == {"a", "b", "c"}
    assert fragments.changed(0, 1, frags) == {"a"}
    for base in (-1, 2, 5, 6, "4", None, True):
        assert fragments.changed(base, 5, frags) is None, base
    assert fragments.changed(-1, 0, frags) is None  # a fresh worker at the first version: never a wrapped fragment
    assert fragments.changed(4, 5, [["a", "b"]]) is None


def test_land_copies_only_what_fits() -> None:
    targets = {"a": torch.zeros(2), "b": torch.zeros(3), "buf": torch.zeros(1)}
    assert fragments.land({"a": torch.ones(2), "buf": torch.full((1,), 2.0)}, targets, ["buf"])
    assert targets["a"].tolist() == [1.0, 1.0] and targets["b"].tolist() == [0.0] * 3 and targets["buf"].item() == 2.0
    for bad, required in (({"a": torch.ones(3)}, []), ({"a": torch.ones(2, dtype=torch.float64)}, []),
                          ({"x": torch.ones(2)}, []), ({"a": torch.tensor([1.0, float("nan")])}, []),
                          ({"a": torch.full((2,), 5.0)}, ["buf"])):
        assert not fragments.land(bad, targets, required), bad
    assert targets["a"].tolist() == [1.0, 1.0]  # nothing copied from a message refused


def test_states_go_up_staggered_by_replica_never_further_apart_than_the_period() -> None:
    """After segment 0, then every `period` segments, offset by replica: a replay never starts more than period − 1
    segments back (the window a held state is accepted in), and a step takes about R / period states, not all R."""
    period, R, S = 3, 8, 40
    for r in range(R):
        starts = [s + 1 for s in range(S) if fragments.ships_state(s, period, r)]
        assert starts[0] == 1 and all(b - a <= period for a, b in zip([0, *starts], starts, strict=False)), (r, starts)
    per_step = [sum(fragments.ships_state(s, period, r) for r in range(R)) for s in range(1, S)]
    assert max(per_step) <= -(-R // period) and min(per_step) >= R // period, per_step
    assert all(fragments.ships_state(s, 1, r) for s in range(5) for r in range(3))  # BatchNorm: every segment
