"""The session's cache of `cmemi reference` summaries (tests/helpers/references.py): one key per config, whatever
its spelling, and a different key for any config whose result may differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import DIGITS, FAST
from tests.helpers import references


def test_one_config_spelled_two_ways_is_one_key() -> None:
    base = references.key(DIGITS, FAST)
    assert references.key(DIGITS, tuple(reversed(FAST))) == base  # the order of the sets
    assert references.key(DIGITS, (*FAST, "compression.downlink=none")) == base  # a default, set explicitly
    assert references.key(DIGITS, (*FAST, "run.name=other", "run.dir=/tmp/elsewhere")) == base  # where, not what


@pytest.mark.parametrize("change", ["train.steps=61", "run.seed=1", "compression.codec=int8",
                                   "model.kwargs.hidden=17", "cluster.workers=3"])
def test_any_other_field_is_another_key(change: str) -> None:
    assert references.key(DIGITS, (*FAST, change)) != references.key(DIGITS, FAST)


def test_the_config_files_content_is_in_the_key(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    text = Path(DIGITS).read_text()
    a.write_text(text)
    b.write_text(text + "\nrun:\n  seed: 5\n")
    assert references.key(str(a), ()) == references.key(DIGITS, ())
    assert references.key(str(b), ()) != references.key(str(a), ())


def test_a_cached_summary_is_a_copy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The second ask of one config runs nothing, and what a test does to its copy reaches no other test."""
    calls: list[tuple[str, ...]] = []

    def fake(out_dir: Path, *sets: str, config: str = DIGITS, timeout: float = 300) -> dict:
        calls.append(sets)
        return {"params_sha256": "ab" * 32, "steps": 60}

    monkeypatch.setattr(references, "compute", fake)
    monkeypatch.setattr(references, "SUMMARIES", {})
    first = references.reference(tmp_path, *FAST, "run.seed=9")
    first["params_sha256"] = "changed"
    again = references.reference(tmp_path, *reversed(FAST), "run.seed=9")
    assert again == {"params_sha256": "ab" * 32, "steps": 60}
    assert len(calls) == 1
