"""Every results file says which code it measured: bench/common.py's provenance (commit, dirty flag, UTC date)
in a throw-away git repository, what emit_result prints, and the lease shape bench/compression.py records for
its `none` baseline."""

from __future__ import annotations

import io
import json
import re
import subprocess
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from bench import common as C
from bench.compression import leases


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "a.json").write_text("{}\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_a_clean_tree_gives_its_full_sha_and_a_utc_date(repo: Path) -> None:
    p = C.provenance(repo)
    assert p["commit"] == git(repo, "rev-parse", "HEAD") and re.fullmatch(r"[0-9a-f]{40}", p["commit"])
    assert p["dirty"] is False and "dirty_paths" not in p
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date"])


def test_uncommitted_code_makes_it_dirty_but_results_being_written_do_not(repo: Path) -> None:
    (repo / "bench" / "results" / "a.json").write_text('{"new": 1}\n')  # `make bench` rewrites results as it goes
    (repo / "bench" / "results" / "b.json.tmp").write_text("")
    assert C.provenance(repo)["dirty"] is False
    (repo / "code.py").write_text("x = 2\n")
    p = C.provenance(repo)
    assert p["dirty"] is True and p["dirty_paths"] == ["code.py"]


def test_outside_a_repository_it_says_so_instead_of_a_commit(tmp_path: Path) -> None:
    p = C.provenance(tmp_path)
    assert p["commit"] is None and p["dirty"] is None and "git" in p["commit_note"]


def test_emit_result_prints_the_provenance_of_a_result_that_had_none() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        C.emit_result({"bench": "x"})
    printed = json.loads(out.getvalue())
    assert re.fullmatch(r"[0-9a-f]{40}", printed["commit"]) and isinstance(printed["dirty"], bool)
    assert printed["date"].endswith("Z")


def test_compression_baseline_is_one_gradient_per_block_lease() -> None:
    """digits (M = 4, W = 2): `none` sends one gradient per block of 2, a stateless lossy codec one per microbatch."""
    none = leases("examples/digits.yaml", ["compression.codec=none"])
    assert (none["lease_microbatches"], none["gradients_per_step"]) == (2, 2)
    fp16 = leases("examples/digits.yaml", ["compression.codec=fp16"])
    assert (fp16["lease_microbatches"], fp16["gradients_per_step"]) == (1, 4)
    three = leases("examples/digits.yaml", ["compression.codec=none", "cluster.workers=3"])
    assert (three["lease_microbatches"], three["gradients_per_step"]) == (2, 2)
