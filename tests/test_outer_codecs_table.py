"""The outer codecs' quality table (scripts/tables/local.py `outer_codecs`, from bench/local_steps.py --codecs) says
what a reader needs to trust it: each row's codec with sparse2's top-k fraction, whether the synchronous baseline was
still learning at the end (the point of the corpus), the goals met, and the runs a cut-short run left out."""

from __future__ import annotations

import json

from scripts.tables import local, provenance


def results(tmp_path, monkeypatch, sync_curve: list[float], missing: list[str] | None = None) -> None:
    monkeypatch.setattr(provenance, "RESULTS", tmp_path)

    def row(system: str, h: int, codec: str, loss: float, vs_sync: float, vs_fp32: float, sets=()) -> dict:
        return {"system": system, "local_steps": h, "fragments": 5 if system == "streaming" else 1, "codec": codec,
                "row": codec, "codec_sets": list(sets), "eval_loss": loss, "vs_sync": vs_sync, "vs_fp32": vs_fp32,
                "curve": [], "params_sha256": "0" * 64, "wall_s": 1.0}

    sync = row("sync", 0, "none", sync_curve[-1], 0.0, 0.0)
    sync["curve"] = [{"samples": 100 * (i + 1), "loss": x} for i, x in enumerate(sync_curve)]
    sync["curve"].append(dict(sync["curve"][-1]))  # the final eval repeats the last periodic one
    d = {"bench": "outer_codecs", "commit": "ab" * 20, "dirty": False, "date": "2026-12-06T10:00:00Z",
         "corpus": "bench/stdlib_corpus.py", "steps": 800, "global_batch": 16, "replicas": 4, "outer": "mild",
         "note": "a shorter run", "codecs": [
             sync, row("whole", 50, "none", 2.2, 0.1, 0.0), row("whole", 50, "int4", 2.21, 0.11, 0.006),
             row("whole", 50, "sparse2", 2.6, 0.3, 0.18),
             row("whole", 50, "sparse2", 2.3, 0.15, 0.045, ("compression.topk_ratio=0.1",))]}
    if missing:
        d["missing"] = missing
    (tmp_path / "outer_codecs.json").write_text(json.dumps(d))


def test_the_table_names_each_codec_and_counts_the_goals(tmp_path, monkeypatch) -> None:
    results(tmp_path, monkeypatch, [2.4, 2.2, 2.1, 2.0])
    text = local.outer_codecs()
    assert "| whole rounds | 50 | sparse2 (1%, 2-bit, per-replica error feedback) | 2.600 | +30.0% | +18.0% |" in text
    assert "| whole rounds | 50 | sparse2 (10%, 2-bit, per-replica error feedback) | 2.300 | +15.0% | +4.5% |" in text
    assert "| whole rounds | 50 | int4 (chunks of 128) | 2.210 | +11.0% | +0.6% |" in text
    assert "2.400, 2.200, 2.100, 2.000 (still falling" in text
    assert "0 of 4 local rows; low-bit changes within 1 % of fp32 changes, 1 of 3 (int4 (chunks of 128))" in text
    assert "Run length: a shorter run" in text
    assert "Not measured" not in text


def test_a_baseline_that_stopped_learning_and_a_cut_run_are_said(tmp_path, monkeypatch) -> None:
    results(tmp_path, monkeypatch, [2.4, 2.2, 2.1, 2.15], missing=["streaming H=200 sparse2"])
    text = local.outer_codecs()
    assert "(NOT still falling)" in text
    assert "Not measured (the run was cut short before them): streaming H=200 sparse2." in text


def test_no_results_file_says_how_to_measure(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(provenance, "RESULTS", tmp_path)
    assert local.outer_codecs().startswith("Not measured yet: `.venv/bin/python bench/local_steps.py --codecs")
