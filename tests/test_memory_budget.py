"""Peak memory per role against issue 34's budgets, on a real cluster big enough for the parameters to show.

A 24 M-parameter MLP (97 MB of fp32) with Adam, `cluster.shards: 2`, 2 workers and a checkpoint mid-run, the step
log on (the default): every process is sampled for VmHWM until it exits (bench/memory.py's PeakSampler) and compared
with its budget (bench/memory.py's `budgets`, the one place the formulas are written: issue 34's, nothing added for
the log, issue 47; bench/memory.py applies the same ones to a 113 M-parameter model). No timing is asserted. The
unit tests below pin the formulas and the manual's memory table.

The one-line changes that fail it (issue 47): services/aggregator/steplog/staging.py's `shm.Writer(..., slots=1)`
back to both slots (shard 0 then peaked at 654 MB against its 624 MB, shard 1 at 641 against 616), or
services/checkpointer/logserver.py's `_landed` landing the entry in memory again.

Every role is held to its budget. Workers give their free heap pages back before each block
(shared/memory/allocator.py): without that, glibc's heap kept the freed 24 MB gradient tensors of earlier microbatches
and a worker peaked between 478 and 579 MB against its 570 MB from one run to the next; with it, 477–481 MB.
"""

from __future__ import annotations

import json

import pytest

from bench import memory
from scripts.tables import memory as memory_tables
from scripts.tables import provenance

MiB = 1 << 20


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_every_role_stays_within_its_memory_budget(tmp_path) -> None:
    interpreter = memory.interpreter_hwm()
    wl = memory.workload(24e6, in_dim=512, depth=4, batch=8)
    r = memory.cluster_run(tmp_path, wl, shards=2, workers=2, steps=8, ckpt_every=4, interpreter=interpreter,
                           timeout=180)
    assert r["checkpoints_saved_at"] == [4, 8], r["checkpoints_saved_at"]  # one mid-run, then the final one
    budgeted = {p["role"] for p in r["processes"] if "budget_MB" in p}
    assert {"shard 0", "shard 1", "worker w0", "worker w1", "checkpointer"} <= budgeted, budgeted
    assert r["step_log"] is True
    table = "\n".join(f"  {p['role']:<30} peak {p['peak_MB']:7.0f} MB  budget {p.get('budget_MB', 0):7.0f} MB"
                      for p in r["processes"] if "budget_MB" in p)
    print(f"interpreter {interpreter / 1e6:.0f} MB, slices {r['slice_MB']} MB:\n{table}")
    assert not r["over_budget"], "\n".join(r["over_budget"]) + "\nevery process:\n" + table


def test_budgets_follow_the_issue_formulas() -> None:
    """Shard: 1.5 × (slice + 2 Adam tensors + one gradient sum); worker: 1.3 × (parameters + gradients);
    checkpointer: 2 transfer caps; each plus the interpreter."""
    b = memory.budgets(400 * MiB, [100 * MiB, 300 * MiB], interpreter=300 * MiB, cap=64 * MiB)
    assert b == {"shard 0": 900 * MiB, "shard 1": 2100 * MiB, "worker": 1340 * MiB, "checkpointer": 428 * MiB}
    assert memory.budgets(400 * MiB, [400 * MiB], 0, 64 * MiB, optimizer="SGD")["shard 0"] == 1800 * MiB
    assert memory.budget_of("worker w1", b) == b["worker"] and memory.budget_of("coordinator", b) is None
    assert memory.cluster_budget(1000) == 1500


def test_slices_come_from_the_piece_assignment() -> None:
    wl = memory.workload(24e6, in_dim=512, depth=4)
    one, two = memory.model_facts(wl, 1), memory.model_facts(wl, 2)
    assert one["slice_bytes"] == [one["param_bytes"]] and sum(two["slice_bytes"]) == two["param_bytes"]
    assert abs(two["slice_bytes"][0] - two["slice_bytes"][1]) <= 4 * MiB  # balanced to a piece (4 MiB at most)
    assert memory.transfer_cap(None, 10 * MiB) == 56 * MiB and memory.transfer_cap(None, 400 * MiB) == 64 * MiB


def results(tmp_path, monkeypatch, **changes):
    d = {"bench": "memory", "commit": "ab" * 20, "dirty": False, "date": "2027-01-02T03:04:05Z",
         "command": "python bench/memory.py", "interpreter_MB": 320.0,
         "model": {"kwargs": {"in_dim": 1024, "hidden": 5967, "depth": 5}, "params": 113_000_000, "param_MB": 452.0,
                   "optimizer": "Adam"},
         "workload": {"workers": 2, "microbatches": 2, "global_batch": 8, "steps": 25, "checkpoint_every": 10},
         "ddp": {"ranks_peak_MB": [2600.0, 2600.0], "ranks_total_MB": 5200.0, "step_time_median_s": 3.2},
         "params_sha256_same": True,
         "by_shards": {"2": {
             "processes": [
                 {"role": "shard 0", "peak_MB": 3000.0, "x_param_bytes": 6.6, "budget_MB": 1700.0, "within_budget": False},
                 {"role": "shard 1", "peak_MB": 1500.0, "x_param_bytes": 3.3, "budget_MB": 1700.0, "within_budget": True},
                 {"role": "worker w0", "peak_MB": 2000.0, "x_param_bytes": 4.4, "budget_MB": 1500.0, "within_budget": False},
                 {"role": "worker w1", "peak_MB": 2100.0, "x_param_bytes": 4.6, "budget_MB": 1500.0, "within_budget": False},
                 {"role": "checkpointer", "peak_MB": 400.0, "x_param_bytes": 0.9, "budget_MB": 455.0, "within_budget": True},
                 {"role": "coordinator", "peak_MB": 40.0, "x_param_bytes": 0.1},
                 {"role": "zygote", "peak_MB": 320.0, "x_param_bytes": 0.7}],
             "cluster_total_MB": 9000.0, "cluster_x_param_bytes": 19.9, "cluster_budget_MB": 7800.0,
             "cluster_vs_ddp_ranks": 1.73, "cluster_within_budget": False, "step_time_median_s": 9.0,
             "step_time_vs_ddp": 2.81, "params_sha256": "cd" * 32}}}
    d.update(changes)
    (tmp_path / "memory.json").write_text(json.dumps(d))
    monkeypatch.setattr(provenance, "RESULTS", tmp_path)
    return d


def test_the_readme_memory_table_shows_every_role_against_its_budget(tmp_path, monkeypatch) -> None:
    results(tmp_path, monkeypatch)
    text = memory_tables.memory()
    assert "| 2 | shard 0 (leader) | 3,000 MB | 6.6 | 1,700 MB | ✗ |" in text
    assert "| 2 | each worker (largest) | 2,100 MB | 4.6 | 1,500 MB | ✗ |" in text  # the worse of the two workers
    assert "| 2 | checkpointer | 400 MB | 0.9 | 455 MB | ✓ |" in text
    assert "| 2 | **whole cluster** | **9,000 MB** | 19.9 | 7,800 MB (1.5 × DDP's 5,200 MB) | ✗ |" in text
    assert "Measured at commit `abababa` on 2027-01-02 (`bench/results/memory.json`)." in text


def test_the_readme_memory_table_flags_a_params_sha256_mismatch(tmp_path, monkeypatch) -> None:
    results(tmp_path, monkeypatch, params_sha256_same=False)
    assert "differ" in memory_tables.memory()


def test_the_readme_memory_table_names_processes_replaced_mid_run(tmp_path, monkeypatch) -> None:
    d = results(tmp_path, monkeypatch)
    assert "replaced mid-run" not in memory_tables.memory()
    d["by_shards"]["2"]["faults"] = [{"kind": "died", "role": "aggregator", "id": "1", "how": "no heartbeat",
                                      "t_s": 30.0, "after_step": 7}]
    (tmp_path / "memory.json").write_text(json.dumps(d))
    assert "K = 2: shard 1 after step 7 (no heartbeat)" in memory_tables.memory()


def test_no_memory_results_yet_says_how_to_make_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(provenance, "RESULTS", tmp_path)
    assert "bench/memory.py --out bench/results/memory.json" in memory_tables.memory()


def test_workers_trim_their_heap_only_for_models_big_enough_to_matter() -> None:
    from cmemi.shared.memory import allocator
    assert allocator.worth_trimming(allocator.TRIM_MIN_BYTES) and not allocator.worth_trimming(21 << 20)
    assert allocator.trim()  # glibc (this image and CI's): the pages go back
