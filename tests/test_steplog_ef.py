"""The step log with a synchronous error-feedback codec (issue 47, "the same with an error-feedback codec"): the
worker's residual is rewound when a step it encoded is asked of it again (services/worker/residual.py), so a run
with leader kills ends bitwise where `cmemi reference` does.

Fast unit tests of the rule on a real codec, and real `cmemi up` runs at W = 1 (where a per-worker residual is
`cmemi reference`'s exactly, docs/guides/compression.md) whose leader is SIGKILLed at points drawn from a seed, with
no checkpoint but the final one: every committed step is replayed from the log, the step in flight is asked again.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from cmemi.services.worker.residual import Rewind
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.config.system import CompressionConfig

from tests.helpers.chaos import Cluster, seeded_steps
from tests.test_steplog_local import FAULTS, lines, reference_of

SYNC = ("train.steps=300", "scheduler.kwargs.T_max=300", "cluster.spare_workers=0", "compression.error_feedback=true")


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 48, generator=g), "v": torch.randn(4096, generator=g)}


def codec(name: str):  # noqa: ANN201 (a GradientCodec)
    return make_codec(CompressionConfig(codec=name, min_compress_numel=16))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["topk", "powersgd", "sign"])
def test_a_step_asked_again_in_a_new_term_encodes_from_the_committed_residual(name: str) -> None:
    """Steps 0 and 1 encoded in term 1, the leader dies before committing 1, term 2 asks step 1 again: what goes out
    and the residual after it are bitwise those of a worker that encoded step 1 once; without the rewind they are not."""
    once = codec(name)
    once.encode(grads(0), 0)
    want = once.encode(grads(1), 1)
    for rewinding in (True, False):
        c = codec(name)
        rw = Rewind(c)
        for term, step in ((1, 0), (1, 1), (2, 1)):
            if rewinding:
                rw.before_encoding(term, step, 0, 4)
            got = c.encode(grads(step), step)
        assert same(got[1], want[1]) is rewinding, (name, rewinding)
        assert same(c.state_dict(), once.state_dict()) is rewinding, (name, rewinding)
        assert rw.rewound == (1 if rewinding else 0)


def test_the_rule_rewinds_only_a_step_asked_again() -> None:
    """The same microbatch again within a term (a shard restarted under the lease) rewinds; another microbatch of the
    same step adds up; a new step keeps the last one's encodings; a stateless codec is left alone; a third asking
    still finds the state from before the first."""
    c = codec("topk")
    rw = Rewind(c)
    assert not rw.before_encoding(1, 0, 0, 2)
    c.encode(grads(0), 0)
    assert not rw.before_encoding(1, 0, 2, 4)  # the step's other microbatches: no rewind
    c.encode(grads(1), 0)
    after0 = {k: t.clone() for k, t in c.state_dict().items()}
    assert not rw.before_encoding(1, 1, 0, 4)  # step 1: step 0 was committed
    c.encode(grads(2), 1)
    assert rw.before_encoding(1, 1, 0, 4)  # same term, same microbatches: asked again
    assert same(c.state_dict(), after0)
    c.encode(grads(2), 1)
    assert rw.before_encoding(3, 1, 2, 4)  # a new term, even for another microbatch of it
    assert same(c.state_dict(), after0)
    assert rw.rewound == 2
    plain = make_codec(CompressionConfig(codec="int8"))
    stateless = Rewind(plain)
    assert not stateless.before_encoding(1, 0, 0, 4) and not stateless.before_encoding(2, 0, 0, 4)


def leader_killed_runs_to_the_reference(tmp_path: Path, sets: tuple[str, ...], spans: list[tuple[int, int]],
                                        server: str | tuple[str, ...] = "0", workers: int = 1) -> Cluster:
    """W = `workers` (1), no checkpoint but the final one, the leader (or shard `server`; a tuple: the server of each span) killed
    once in each span of steps (drawn from a fresh seed, named in every failure): `cmemi reference`'s params_sha256,
    no step twice, a replay per kill, nothing redone. Returns the finished cluster."""
    seed, targets = seeded_steps(spans)
    want = reference_of(tmp_path, *sets, "checkpoint.every_steps=0", "cluster.workers=1")
    c = Cluster(tmp_path / "run", *sets, *FAULTS, "checkpoint.every_steps=0", f"cluster.workers={workers}")
    servers = (server,) * len(targets) if isinstance(server, str) else server
    try:
        killed_at = [c.kill_at("aggregator", s, [t], replace_timeout=90)[0]
                     for s, t in zip(servers, targets, strict=True)]
    finally:
        rc = c.wait(timeout=200)
    note = f"seed {seed}, kills at steps {killed_at}"
    assert rc == 0, f"{note}\n{c.output()}"
    assert c.summary["params_sha256"] == want, note
    steps = [e["step"] for e in lines(c.run_dir, "metrics.jsonl") if "loss" in e and "eval" not in e]
    twice = sorted(n for n, k in Counter(steps).items() if k > 1)
    assert not twice, f"steps trained twice: {twice[:20]} ({note})"
    events = lines(c.run_dir, "events.jsonl")
    replays = [e for e in events if e["kind"] == "step_log_replayed" and e["replayed"] > 0]  # each killed server's own
    assert all(sum(e["shard"] == int(s) for e in replays) >= servers.count(s) for s in set(servers)), (note, replays)
    assert all(e["checkpoint"] == 0 for e in replays), note
    assert [e for e in events if e["kind"] == "steps_redone"] == [], note
    # a new term per leader kill, and per shard kill that the leader did not take back within its term (roster.py)
    new_terms = servers.count("0") + sum(not e["term_kept"] for e in events if e["kind"] == "shard_restarted")
    assert c.summary["term"] == new_terms + 1, note
    return c


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(400)
def test_topk_with_error_feedback_leader_killed_ends_at_the_reference(tmp_path: Path) -> None:
    """topk (1 %), error feedback: two leader kills, each in mid-run; the step in flight was encoded under the dead
    term and is encoded again from the residual before it."""
    leader_killed_runs_to_the_reference(tmp_path, (*SYNC, "compression.codec=topk"), [(40, 120), (160, 240)])


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(400)
def test_powersgd_with_error_feedback_leader_killed_ends_at_the_reference(tmp_path: Path) -> None:
    """PowerSGD, rank 2: its residual and its warm-started Q are both rewound."""
    sets = (*SYNC, "compression.codec=powersgd", "compression.powersgd_rank=2")
    leader_killed_runs_to_the_reference(tmp_path, sets, [(40, 120), (160, 240)])


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(400)
def test_topk_with_error_feedback_shard_killed_ends_at_the_reference(tmp_path: Path) -> None:
    """K = 2, shard 1 SIGKILLed twice: each restart starts a new term, which asks the step in flight again (the
    worker had encoded both shards' slices of it)."""
    sets = (*SYNC, "compression.codec=topk", "cluster.shards=2")
    leader_killed_runs_to_the_reference(tmp_path, sets, [(40, 120), (160, 240)], server="1")
