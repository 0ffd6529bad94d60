"""Sharded parameter servers (cluster.shards): the chunk grid, one result for any K and W, clipping and fp16
at K = 3, shards SIGKILLed mid-run, one logical checkpoint per step, traffic per step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import config_from_dict
from cmemi.shared.core.grid import CHUNK, Partition, clip_coefficient, join
from cmemi.shared.memory import shm
from safetensors.torch import load_file

from tests.conftest import FAST, LONG, ROOT, cmemi_cmd, run_up
from tests.helpers import references
from tests.helpers.chaos import Cluster


def reference_sha(tmp_path: Path, *sets: str) -> str:
    """`cmemi reference`'s params_sha256, once per config per session (tests/helpers/references.py)."""
    return str(references.reference(tmp_path, *sets)["params_sha256"])


# ---------------------------------------------------------------------------------------------- the grid (unit)

def test_a_low_rank_codec_factors_whole_tensors_on_a_grid_that_still_does_not_depend_on_k() -> None:
    """compression.downlink powersgd: pieces as big as CHUNK, so a matrix is factored whole, not as thin
    slices of rows whose factors cost nearly as much as the slice (shared/core/grid.py)."""
    from cmemi.shared.compression.registry import make_codec
    from cmemi.shared.compression.sizes import wire_bytes
    from cmemi.shared.config.system import CompressionConfig

    params = {"w": torch.randn(512, 784), "v": torch.randn(512, 512), "b": torch.zeros(512),
              "huge": torch.zeros(3000, 600)}  # 7.2 MB: still cut, into pieces of at most CHUNK
    fine, coarse = Partition(params, 8), Partition(params, 8, whole=True)
    assert CompressionConfig(codec="powersgd", downlink="powersgd").whole_pieces
    assert not CompressionConfig(codec="powersgd").whole_pieces, "dense parameters down: K shards share them evenly"
    assert not CompressionConfig(codec="topk", downlink="topk").whole_pieces
    assert CompressionConfig(codec="powersgd", downlink="sign").whole_pieces  # the uplink's factors: whole tensors
    assert not CompressionConfig(codec="powersgd", downlink="int8").whole_pieces  # a quarter of the parameters down
    assert not CompressionConfig(codec="powersgd", downlink="int4").whole_pieces  # 17 / 128 of them
    assert [p.name for p in coarse.pieces] == [p.name for p in Partition(params, 1, whole=True).pieces]
    assert [p.name for p in coarse.pieces][:3] == ["w", "v", "b"] and all(p.nbytes <= CHUNK for p in coarse.pieces)
    assert sum(p.param == "huge" for p in coarse.pieces) == 2 and sum(p.param == "w" for p in fine.pieces) > 8
    sent = {}
    for name, part in (("fine", fine), ("coarse", coarse)):
        views = {n: v for n, v in part.views(params).items() if not n.startswith("huge")}
        _, frames = make_codec(CompressionConfig(codec="powersgd")).encode(views, 0)
        sent[name] = wire_bytes(frames)
    assert sent["fine"] > 5 * sent["coarse"], sent


def test_grid_cuts_big_tensors_by_rows_balances_bytes_and_joins_back() -> None:
    params = {"small": torch.zeros(10, 3), "big": torch.arange(1_200_000, dtype=torch.float32),
              "wide": torch.zeros(3000, 600), "bias": torch.zeros(7)}
    one, three = Partition(params, 1), Partition(params, 3)
    assert [p.name for p in one.pieces] == [p.name for p in three.pieces], "the grid does not depend on K"
    names = [p.name for p in one.pieces]
    assert names[:3] == ["small", "big#0", "big#1"] and "bias" in names and one.split
    assert all(p.nbytes <= CHUNK for p in one.pieces)
    owners = [three.owner[n] for n in names]
    assert owners == sorted(owners) and set(owners) == {0, 1, 2}, "contiguous runs, every shard used"
    sizes = [three.bytes_of(k) for k in range(3)]
    assert max(sizes) - min(sizes) <= max(p.nbytes for p in three.pieces), "balanced to within one piece"
    pieces = {n: v.clone() for n, v in one.views(params).items()}
    whole = join(one.describe(), pieces)
    assert whole.keys() == params.keys() and all(torch.equal(whole[n], params[n]) for n in params)
    grads = {n: torch.full_like(v, 0.5) for n, v in pieces.items()}
    norm, coef = clip_coefficient(one.partials(grads), 1.0)
    expected = float(torch.nn.utils.get_total_norm([torch.full_like(p, 0.5) for p in params.values()]))
    assert norm == pytest.approx(expected, rel=1e-6) and coef == pytest.approx(1.0 / (expected + 1e-6))
    partials = [x for k in range(3) for x in three.partials(grads, k)]
    assert partials == one.partials(grads), "every shard's partials, in shard order, are the grid's"


def test_a_worker_tells_the_answer_to_its_pull_from_a_late_answer_to_an_earlier_one() -> None:
    """A pull of version 4 answered late, when the shard was at 5 (no tensors, version 5), is not an answer to a
    pull of 5: taking it as one made every lease of step 5 look stale, again and again."""
    from types import SimpleNamespace

    from cmemi.services.worker.links.shard_links import answers

    def got(version: int, asked: int, tensors: bool) -> SimpleNamespace:
        header = {"version": version, "asked": asked, "shard": 1}
        return SimpleNamespace(header=header, tensors={"w": torch.zeros(1)} if tensors else {})

    assert not answers(got(5, 4, False), 5)  # a late "step 4 is over"
    assert answers(got(5, 5, True), 5)
    assert answers(got(6, 5, False), 5)  # "step 5 is over": the lease is stale
    assert not answers(got(6, 6, True), 5)  # asked ahead: pull 5 itself
    assert not answers(None, 5)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("optimizer", {"name": "LBFGS"}, "optimizer.name"),
    ("optimizer", {"name": "Adafactor"}, "optimizer.name"),
])
def test_sharding_refuses_what_it_would_change(field: str, value: dict, words: str) -> None:
    base = {"model": {"factory": "cmemi.examples.digits:make_model"},
            "data": {"factory": "cmemi.examples.digits:make_dataset"}, "cluster": {"shards": 2}}
    with pytest.raises(ConfigError, match=words) as err:
        config_from_dict({**base, field: value})
    assert "cluster.shards: 1" in str(err.value)
    config_from_dict({**base, "cluster": {"shards": 1}, field: value})  # fine with one shard


# ---------------------------------------------------------------------------------------------- real clusters

@pytest.mark.integration
def test_one_result_for_any_shards_and_workers(tmp_path: Path) -> None:
    """K = 1, 2, 3 x W = 1, 2, 3: one params_sha256, the single-process reference's. Also: one logical
    checkpoint of a sharded run is all K slices, and `cmemi checkpoints export` gives one whole file."""
    sets = (*FAST, "train.steps=30", "scheduler.kwargs.T_max=30")
    want = reference_sha(tmp_path, *sets)
    got = {}
    for k in (1, 2, 3):
        for w in (1, 2, 3):
            r = run_up(tmp_path / f"k{k}w{w}", *sets, f"cluster.shards={k}", f"cluster.workers={w}")
            assert r.rc == 0, r.stderr[-3000:]
            got[(k, w)] = r.summary["params_sha256"]
    assert set(got.values()) == {want}, got
    run = tmp_path / "k3w3"
    s = json.loads((run / "summary.json").read_text())  # the cluster's bytes, and every shard's share of them
    assert [x["shard"] for x in s["shards"]] == [0, 1, 2] and all(x["bytes_sent"] > 0 for x in s["shards"])
    assert s["bytes_sent"] == sum(x["bytes_sent"] for x in s["shards"])
    assert s["bytes_received"] == sum(x["bytes_received"] for x in s["shards"])
    (ckpt,) = sorted((run / "checkpoints").glob("step-*"))
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["shards"] == 3 and len(meta["per_shard"]) == 3
    out = tmp_path / "export.safetensors"
    proc = subprocess.run(cmemi_cmd("checkpoints", "export", str(run), "-o", str(out)), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    exported, final = load_file(str(out)), load_file(str(run / "model.safetensors"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[n], final[n]) for n in final)


@pytest.mark.integration
def test_resume_with_another_shard_count_matches_the_reference(tmp_path: Path) -> None:
    """Scale a run out and back in: 30 steps at K = 2, resumed to 45 at K = 3, then to 60 at K = 1 (`--resume` with
    `cluster.shards` changed): the 60-step reference's params_sha256, and the run's bytes still add up."""
    from tests.conftest import up_args

    sets = ("scheduler.kwargs.T_max=60", "cluster.spare_workers=0", "checkpoint.every_steps=10", "cluster.workers=2")
    run = tmp_path / "run"
    first = run_up(run, *sets, "train.steps=30", "cluster.shards=2")
    assert first.rc == 0, first.stderr[-3000:]
    sent = [first.summary["bytes_sent"]]
    for steps, k in ((45, 3), (60, 1)):
        proc = subprocess.run([*up_args(run, *sets, f"train.steps={steps}", f"cluster.shards={k}"), "--resume"],
                              cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        s = json.loads((run / "summary.json").read_text())
        assert s["steps"] == steps, s
        sent.append(s["bytes_sent"])
    assert s["params_sha256"] == reference_sha(tmp_path, *FAST, "train.steps=60")
    assert 0 < sent[0] < sent[1] < sent[2], f"bytes sent after each part: {sent}"


@pytest.mark.integration
def test_a_message_cap_under_one_slice_at_two_shards(tmp_path: Path) -> None:
    """cluster.max_message_bytes=65536 under each shard's ~260 kB slice: gradients to each shard, parameters back,
    the other shard's pieces to the leader (final, evaluation) and both shards' snapshots to the checkpointer, at
    once, all travel in parts. A checkpoint every step, faster than they can be written: the leader names the
    steps both shards snapshot, so periodic checkpoints keep completing (with the shards picking their own, and
    the checkpointer taking one transfer in parts at a time, none did after the first and the final one hung).
    The run ends like the reference and no part was refused."""
    model = ("model.factory=tests.helpers.fixtures:many_tensors_mlp", "model.kwargs={n: 1, size: 100000}")
    r = run_up(tmp_path / "run", *FAST, *model, "cluster.shards=2", "cluster.workers=2",
               "cluster.max_message_bytes=65536", "checkpoint.every_steps=1", "checkpoint.keep_last=100", timeout=120)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary["params_sha256"] == reference_sha(tmp_path, *FAST, *model)
    # no part refused: the only drops allowed are a lease also handed to an idle worker on a loaded machine, its
    # second copy (computed twice, the first won: 3 runs of 15 at load average 7-18)
    reissued = {"duplicate", "stale_step"}
    assert set(r.summary["dropped_messages"]) <= reissued, r.summary["dropped_messages"]
    assert not r.summary["checkpointer_dropped_messages"], r.summary["checkpointer_dropped_messages"]
    assert all(set(x.get("dropped_messages") or {}) <= reissued for x in r.summary["shards"]), r.summary["shards"]
    saved = sorted((r.run_dir / "checkpoints").glob("step-*"))
    assert len(saved) >= 3, saved  # periodic ones besides the first, then the final one
    assert all(json.loads((c / "meta.json").read_text())["shards"] == 2 for c in saved)
    assert saved[-1].name.endswith("60")
    assert "given up" not in (r.run_dir / "logs" / "checkpointer.log").read_text()


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(300)
def test_a_leader_killed_as_the_run_ends_gets_every_shard_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 2: the leader SIGKILLed as its end begins (tests/helpers/inject), after shard 1 applied the last step and
    before the final checkpoint is written, which that term then never completes. Shard 1 waits for it from its loop,
    so it sees the new term, leaves its own and joins the new one (before issue 47's fix it waited in `save_final`
    for 300 s and the new leader for it: the run hung); the new leader, its log holding the last step, waits for
    it, and the shard that joins at the last step ends the run there too. Bitwise the reference, in term 2."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests' / 'helpers' / 'inject'}")
    monkeypatch.setenv("CMEMI_TEST_KILL_LEADER_AT_FINISH", str(tmp_path / "killed"))
    r = run_up(tmp_path / "run", *FAST, "cluster.shards=2", "cluster.workers=2", timeout=150)
    assert r.rc == 0, r.stderr[-3000:]
    assert (tmp_path / "killed").exists()
    assert r.summary["params_sha256"] == reference_sha(tmp_path, *FAST)
    assert r.summary["steps"] == 60 and r.summary["term"] == 2, r.summary
    lines = [json.loads(x) for x in (r.run_dir / "events.jsonl").read_text().splitlines()]
    died = [e for e in lines if e["kind"] == "died"]
    assert [(e["role"], e["id"]) for e in died] == [("aggregator", "0")], died
    shard1 = [e for e in lines if e["kind"] == "startup" and e["role"] == "aggregator" and e["id"] == "1"]
    assert len(shard1) == 2, shard1  # shard 1 left term 1 and joined term 2
    assert "leaving the term" in (r.run_dir / "logs" / "aggregator-1.log").read_text()


def test_a_sharded_step_a_shard_already_passed_is_given_up() -> None:
    """The checkpointer's merge: shard 0 sent step 6, shard 1 step 10. Shard 1 sends its steps in order, so step 6
    will never be complete: it is given up (shard 0 is told) as soon as step 10 comes, not left to wait for a
    slice that never comes while shard 0 waits for its answer."""
    from cmemi.services.checkpointer.merge import Merger

    def header(step: int, shard: int, term: int = 1) -> dict:
        return {"step": step, "shard": shard, "shards": 2, "term": term, "pieces": {}, "meta": {}, "final": False}

    m = Merger()
    assert m.add(b"s0", header(6, 0), {}) == (None, [])
    done, given_up = m.add(b"s1", header(10, 1), {})
    assert done is None and given_up == [(6, [b"s0"])]
    done, given_up = m.add(b"s0", header(10, 0), {})
    assert done is not None and sorted(done.slices) == [0, 1] and given_up == []
    # a new term (a rollback) starts over: its older steps are not "passed"
    assert m.add(b"s1", header(4, 1, term=2), {}) == (None, [])
    done, _ = m.add(b"s0", header(4, 0, term=2), {})
    assert done is not None


@pytest.mark.integration
@pytest.mark.parametrize(("skip", "pipelined"), [
    ("20:1", ()),
    ("20:1:1", ("cluster.pipeline_stages=3", "model.factory=tests.helpers.fixtures:many_tensors_mlp",
                "model.kwargs={n: 6, size: 20000}")),
], ids=["two-phase", "pipelined"])
def test_a_slice_lost_between_sends_is_leased_again_and_recomputed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  skip: str, pipelined: tuple[str, ...]) -> None:
    """K = 3, one worker: its gradient of step 20 never reaches shard 1 (tests/helpers/inject, as when a worker dies between
    its sends), and it forgets the slices it held, as its replacement would. Shard 1 lacks the step, so the leader
    leases it again once the grace is over, and the worker pulls version 20 anew from both shards, past the next
    version it had asked ahead for. Pipelined, shard 1 gets stage 0 and steps it, and shard 2 steps all of its
    stages: version 20 of those comes from the copies kept until the commit. Bitwise the reference."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests' / 'helpers' / 'inject'}")
    monkeypatch.setenv("CMEMI_TEST_SKIP_SHARD", skip)
    sets = (*FAST, "train.steps=30", "scheduler.kwargs.T_max=30", "cluster.dead_after=1.0",
            "cluster.heartbeat_interval=0.1", *pipelined)
    r = run_up(tmp_path / "run", *sets, "cluster.shards=3", "cluster.workers=1")
    assert r.rc == 0, r.stderr[-3000:]
    events = [json.loads(x) for x in (r.run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["shard"]) for e in events if e["kind"] == "leases_reopened"][:1] == [(20, 1)], events
    worker_log = (r.run_dir / "logs" / "worker-w0.log").read_text()
    assert "lost a parameter-server shard" not in worker_log, "every shard answered the pull of version 20 at once"
    monkeypatch.delenv("CMEMI_TEST_SKIP_SHARD")
    assert r.summary["params_sha256"] == reference_sha(tmp_path, *[x for x in sets if "pipeline" not in x])


@pytest.mark.integration
def test_evaluation_during_training_and_early_stopping_at_two_shards(tmp_path: Path) -> None:
    """eval.every_steps at K = 2: the leader evaluates the whole model of each boundary step (the other shard sends
    its pieces of it), so the metrics are one shard's; early stopping stops every shard at the same step."""
    evals = {}
    for k in (1, 2):
        r = run_up(tmp_path / f"eval{k}", *FAST, "eval.every_steps=20", f"cluster.shards={k}", "cluster.workers=2")
        assert r.rc == 0, r.stderr[-3000:]
        evals[k] = r.summary["eval_history"]
    assert [e["step"] for e in evals[2]] == [20, 40] and evals[2] == evals[1]
    stop = ("eval.fn=tests.helpers.fixtures:constant_eval", "eval.every_steps=10", "eval.early_stop_metric=score",
            "eval.patience=1")  # best at 10, no better at 20: decided at the 30 boundary
    r = run_up(tmp_path / "stop", *FAST, *stop, "cluster.shards=2", "cluster.workers=2")
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary["stopped_early"] and r.summary["steps"] == 30
    assert r.summary["params_sha256"] == reference_sha(tmp_path, *FAST, "train.steps=30")
    last = sorted((r.run_dir / "checkpoints").glob("step-*"))[-1]  # the final checkpoint: both slices of step 30
    assert last.name.endswith("30") and json.loads((last / "meta.json").read_text())["shards"] == 2


@pytest.mark.integration
def test_big_tensors_clipping_and_fp16_at_three_shards(tmp_path: Path) -> None:
    """A 4.8 MB tensor cut into two pieces (on two shards), clipping that clips, and fp16 loss scaling with a
    poisoned sample that overflows: K = 3 is bitwise the reference, the same skipped steps."""
    sets = (*FAST, "train.steps=30", "scheduler.kwargs.T_max=30", "model.factory=tests.helpers.fixtures:many_tensors_mlp",
            "model.kwargs={n: 1, size: 1200000}", "train.clip_grad_norm=0.05", "precision=fp16",
            "data.factory=tests.helpers.fixtures:poisoned_digits", "data.kwargs={index: 5}")
    want = reference_sha(tmp_path, *sets)
    r = run_up(tmp_path / "k3", *sets, "cluster.shards=3", "cluster.workers=2")
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary["params_sha256"] == want
    assert r.summary["skipped_steps"] >= 1, "the poisoned sample must overflow a step"


@pytest.mark.integration
def test_traffic_per_step_is_about_one_gradient_per_worker(tmp_path: Path) -> None:
    """M = 8, W = 2: each worker holds a block of 4 leaves and sends one gradient a step (docs/design.md, Leases)."""
    r = run_up(tmp_path / "run", *FAST, "train.microbatches=8", "cluster.workers=2", "train.log_every=1")
    assert r.rc == 0, r.stderr[-3000:]
    grad_bytes = sum(t.numel() * 4 for t in load_file(str(r.run_dir / "model.safetensors")).values())
    steps = [m for m in r.metrics() if "bytes_in" in m][5:]  # past start-up's re-asks
    worst = max(m["bytes_in"] for m in steps)
    assert worst <= 2 * 2 * grad_bytes + 2 * 2 * 4096, f"{worst} bytes in a step, a gradient is {grad_bytes}"


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.parametrize("pipelined", [(), ("cluster.pipeline_stages=2",)], ids=["two-phase", "pipelined"])
def test_shards_killed_mid_run_roll_back_and_still_match(tmp_path: Path, reference: str,
                                                         pipelined: tuple[str, ...]) -> None:
    """SIGKILL shard 1, then shard 2, then the leader, and workers in between (one may die between its slices:
    what a shard lacks is leased again), then shards 1 and 2 at once: each shard's death takes the cluster back to the last checkpoint every
    shard completed, and the result is still bitwise the fault-free one. With evaluation every 100 steps: an
    evaluation lost with a term runs again from the checkpoint, so the history is the fault-free run's. The same
    with pipelined steps (the leader then holds no parameters, and stages are stepped before the commit). Without
    the step log (`checkpoint.step_log: false`): with it, a shard's restart is taken within the term instead
    (issue 47: tests/test_steplog_sharded.py)."""
    evals = ("eval.fn=cmemi.examples.digits:evaluate", "eval.every_steps=100")
    plain = run_up(tmp_path / "plain", *LONG, *evals, "cluster.workers=1", "cluster.spare_workers=0")
    assert plain.rc == 0, plain.stderr[-3000:]
    c = Cluster(tmp_path / "run", *LONG, *evals, "checkpoint.every_steps=50", "cluster.workers=2", "cluster.shards=3",
                "checkpoint.step_log=false", *pipelined)
    try:
        for target, victims in ((150, [("aggregator", "1")]), (300, [("worker", "w0")]), (450, [("aggregator", "2")]),
                                (600, [("worker", "w1")]), (750, [("aggregator", "0")]), (900, [("worker", "w0")]),
                                (1050, [("aggregator", "1"), ("aggregator", "2")])):
            c.wait_step(target)
            killed = [(role, ident, c.signal(role, ident)) for role, ident in victims]
            for role, ident, inc in killed:
                c.replaced(role, ident, inc)
    finally:
        rc = c.wait(timeout=400)
    assert rc == 0, c.output()
    assert shm.owned(c.run) == []  # the killed shards' and workers' slot segments were swept, the rest unlinked
    s = c.summary
    assert s["steps"] == 1200 and s["params_sha256"] == reference == plain.summary["params_sha256"]
    assert s["eval_history"] == plain.summary["eval_history"] and len(s["eval_history"]) == 11
    events = [json.loads(x) for x in (c.run_dir / "events.jsonl").read_text().splitlines()]
    # the two at once: the first to rejoin rolls the cluster back, the other may join the new term directly
    assert len([e for e in events if e["kind"] == "shard_restarted"]) in (3, 4)
    restored = [e["step"] for e in events if e["kind"] == "checkpoint_restored"]
    assert len(restored) >= 4 * 3 and all(step % 50 == 0 for step in restored), restored


# ---------------------------------------------------------------------------------------------- resharding (unit)

def _grads(trainer, step: int) -> dict[str, torch.Tensor]:
    """A made-up mean gradient of `step` for this shard's pieces: a function of (step, piece), not of K."""
    out = {}
    for name, piece in trainer.pieces.items():
        g = torch.Generator().manual_seed(hash((step, name)) % (1 << 31))
        out[name] = torch.randn(piece.shape, generator=g)
    return out


def _step_all(trainers, step: int) -> None:
    for t in trainers:
        t.apply(_grads(t, step))


def _checkpoint(trainers) -> tuple[dict, dict]:
    """What a restore gets of these shards' snapshots: each received as the checkpointer receives it (spooled to
    disk), merged when K > 1, written as a checkpoint and read back."""
    import tempfile

    from cmemi.services.aggregator.common.totals import RunTotals
    from cmemi.services.aggregator.snapshots.contents import collect
    from cmemi.services.checkpointer import spool
    from cmemi.services.checkpointer.merge import Pending, merged
    from cmemi.services.checkpointer.store import CheckpointStore
    from cmemi.shared.wire import assembly, transfer

    snaps = [collect(t, RunTotals(bytes_in=100 * (k + 1), bytes_out=10 * (k + 1)), 1, {"sha256": "x"}, None)
             for k, t in enumerate(trainers)]
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(Path(tmp))
        received = []
        for k, (step, meta, tensors) in enumerate(snaps):
            asm = assembly.Assembler("r", 1 << 30, sink=lambda of, metas, k=k, step=step: spool.Spool(
                store.root, step, k, metas, lambda exc, attempt: None))
            fields = {"step": step, "term": 1, "final": False, "meta": meta}
            msg = None
            for m in transfer.messages("snapshot", "r", fields, 1 << 18, tensors):
                msg = asm.decode(b"", m)
            assert msg is not None
            received.append(msg.tensors)
        if len(trainers) == 1:
            meta, tensors = snaps[0][1], received[0]
        else:
            p = Pending(1, len(trainers), trainers[0].partition.describe())
            for k, (_, meta, _) in enumerate(snaps):
                p.slices[k] = (meta, received[k])
            meta, tensors = merged(p)
        path = store.write(snaps[0][0], meta, tensors)
        for r in received:
            spool.discard(r)
        meta, tensors = store.load(path)
        return meta, {n: t.clone() for n, t in tensors.items()}


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1), (1, 2)])
def test_a_checkpoint_resumes_with_another_shard_count_bitwise(before: int, after: int) -> None:
    """Steps 1-4 at K = before, checkpoint, steps 5-8 at K = after: bitwise the same as 8 steps at K = 1, with
    momentum, Adam-style state, a param group of its own (weight decay off for biases) and a schedule, on a model
    whose big tensor is cut into pieces that change owner."""
    from cmemi.services.aggregator.common.totals import RunTotals
    from cmemi.services.aggregator.common.trainer import Trainer
    from cmemi.services.aggregator.snapshots.contents import restore

    for opt in ({"name": "SGD", "kwargs": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
                {"name": "AdamW", "kwargs": {"lr": 0.01, "weight_decay": 0.1},
                 "param_groups": [{"match": r"bias", "weight_decay": 0.0}]}):
        cfg = config_from_dict({"model": {"factory": "tests.helpers.fixtures:many_tensors_mlp", "kwargs": {"n": 2, "size": 300_000}},
                                "data": {"factory": "cmemi.examples.digits:make_dataset"}, "optimizer": opt,
                                "scheduler": {"name": "CosineAnnealingLR", "kwargs": {"T_max": 8}},
                                "train": {"steps": 8}})
        straight = Trainer(cfg, shard=0, shards=1)
        for s in range(8):
            _step_all([straight], s)
        first = [Trainer(cfg, shard=k, shards=before) for k in range(before)]
        assert len({t.partition.owner[n] for t in first for n in t.pieces}) == before
        for t in first:
            t.keep_own_rows()  # as the servers do after start-up: each holds its own rows only
            held = sum(p.numel() for p in t.model.parameters()) + sum(
                p.numel() for n, p in t.pieces.items() if p is not t.params.get(n))
            assert before == 1 or held == sum(p.numel() for p in t.pieces.values()), "a shard keeps rows it does not own"
        for s in range(4):
            _step_all(first, s)
        meta, tensors = _checkpoint(first)
        second = [Trainer(cfg, shard=k, shards=after) for k in range(after)]
        totals = [RunTotals() for _ in second]
        for t, tot in zip(second, totals, strict=True):
            restore(t, tot, None, None, meta, tensors)
            assert t.step == 4 and t.lr == first[0].lr
            t.keep_own_rows()
        assert sum(tot.bytes_in for tot in totals) == sum(100 * (k + 1) for k in range(before)), "bytes kept whole"
        for s in range(4, 8):
            _step_all(second, s)
        pieces = {n: p for t in second for n, p in t.pieces.items()}
        assert pieces.keys() == straight.pieces.keys()
        for n, p in straight.pieces.items():
            assert torch.equal(pieces[n], p), f"{opt['name']}: piece {n} differs after {before} -> {after} shards"
        leader = second[0]  # the end of a run: the whole model again, the other shards' rows placed into it
        others = {k: {n: p.detach().clone() for n, p in t.pieces.items()} for k, t in enumerate(second[1:], start=1)}
        assert leader.params_sha256(others) == straight.params_sha256()  # piece by piece, the model not built
        leader.materialize(others)
        assert leader.params_sha256() == straight.params_sha256()
        for n, view in leader.partition.views(leader.params, 0).items():  # its own rows: one copy, in the model
            assert view.data_ptr() == leader.pieces[n].data_ptr()
        for pieces in others.values():  # a tensor another shard owned whole is the received one, not a copy
            whole = [n for n in pieces if n in leader.params]
            assert all(leader.params[n].data_ptr() == pieces[n].data_ptr() for n in whole)


# ---------------------------------------------------------------------------------------------- pipelined steps

def test_pipelined_partition_leaves_the_leader_nothing_and_cuts_each_slice_into_stages() -> None:
    params = {"small": torch.zeros(10, 3), "big": torch.arange(1_200_000, dtype=torch.float32),
              "wide": torch.zeros(3000, 600), "bias": torch.zeros(7)}
    plain, piped = Partition(params, 3), Partition(params, 3, stages=4)
    assert [p.name for p in piped.pieces] == [p.name for p in plain.pieces], "the grid does not depend on stages"
    assert piped.owned(0) == [] and piped.staged(0) == [[], [], [], []], "the leader holds no parameters"
    owners = [piped.owner[p.name] for p in piped.pieces]
    assert owners == sorted(owners) and set(owners) == {1, 2}
    for k in (1, 2):
        stages = piped.staged(k)
        assert len(stages) == 4 and [n for s in stages for n in s] == [p.name for p in piped.owned(k)], "grid order"
    assert plain.staged(1) == [[p.name for p in plain.owned(1)]], "not pipelined: one stage, the whole slice"
    assert Partition(params, 1, stages=4).stages == 0, "one shard: nothing to pipeline"


@pytest.mark.parametrize(("sets", "words"), [
    ({"cluster": {"shards": 1, "pipeline_stages": 2}}, "cluster.shards >= 2"),
    ({"cluster": {"shards": 2, "pipeline_stages": 2}, "train": {"clip_grad_norm": 1.0}}, "train.clip_grad_norm"),
    ({"cluster": {"shards": 2, "pipeline_stages": 2}, "precision": "fp16"}, "precision"),
    ({"cluster": {"shards": 2, "pipeline_stages": 65}}, "0..64"),
])
def test_pipelining_refuses_what_needs_the_whole_step(sets: dict, words: str) -> None:
    base = {"model": {"factory": "cmemi.examples.digits:make_model"},
            "data": {"factory": "cmemi.examples.digits:make_dataset"}}
    with pytest.raises(ConfigError, match=words) as err:
        config_from_dict({**base, **sets})
    assert "cluster.pipeline_stages" in str(err.value)


def _step_staged(trainers, step: int) -> None:
    """A pipelined step: every stage of every shard on its own, in an order no run guarantees, then the schedule."""
    for t in trainers:
        grads = _grads(t, step)
        for names in reversed(t.partition.staged(t.shard)):
            t.apply_stage({n: grads[n] for n in names})
        t.end_step()


def test_pipelined_stages_step_bitwise_as_one_step_and_resume_either_way() -> None:
    """4 steps pipelined at K = 3 (stages stepped one by one, the leader holding nothing), checkpoint, 4 steps
    two-phase at K = 3 (the same K, other owners), checkpoint, 4 steps pipelined at K = 2: bitwise 12 steps at K = 1,
    with momentum, Adam-style state and a param group of its own."""
    from cmemi.services.aggregator.common.totals import RunTotals
    from cmemi.services.aggregator.common.trainer import Trainer
    from cmemi.services.aggregator.snapshots.contents import restore

    for opt in ({"name": "SGD", "kwargs": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
                {"name": "AdamW", "kwargs": {"lr": 0.01, "weight_decay": 0.1},
                 "param_groups": [{"match": r"bias", "weight_decay": 0.0}]}):
        def cfg(shards: int, stages: int, opt: dict = opt):
            return config_from_dict({
                "model": {"factory": "tests.helpers.fixtures:many_tensors_mlp", "kwargs": {"n": 2, "size": 300_000}},
                "data": {"factory": "cmemi.examples.digits:make_dataset"}, "optimizer": opt,
                "scheduler": {"name": "CosineAnnealingLR", "kwargs": {"T_max": 12}}, "train": {"steps": 12},
                "cluster": {"shards": shards, "pipeline_stages": stages}})

        straight = Trainer(cfg(1, 0))
        for s in range(12):
            _step_all([straight], s)
        parts = [(3, 3, _step_staged), (3, 0, _step_all), (2, 5, _step_staged)]
        trainers: list = []
        for i, (k, stages, step) in enumerate(parts):
            new = [Trainer(cfg(k, stages), shard=j) for j in range(k)]
            if stages:
                assert not new[0].pieces and all(new[j].pieces for j in range(1, k))
            if trainers:
                meta, tensors = _checkpoint(trainers)
                for t in new:
                    restore(t, RunTotals(), None, None, meta, tensors)
                    assert t.step == 4 * i and t.lr == trainers[0].lr
            trainers = new
            for s in range(4 * i, 4 * i + 4):
                step(trainers, s)
        pieces = {n: p for t in trainers for n, p in t.pieces.items()}
        assert pieces.keys() == straight.pieces.keys()
        for n, p in straight.pieces.items():
            assert torch.equal(pieces[n], p), f"{opt['name']}: piece {n} differs"


@pytest.mark.integration
def test_pipelined_steps_give_the_reference_for_any_shards_workers_and_a_batchnorm_model(tmp_path: Path) -> None:
    """cluster.pipeline_stages: K = 2, 3 x W = 1, 3 on the digits MLP (dropout; 3 stages over 2 pieces per shard, so
    some stages are empty), and the ResNet example (BatchNorm statistics travelling with the leader's work,
    dropout, torch/numpy/random augmentation) at K = 3, W = 2: the single-process reference's params_sha256."""
    sets = (*FAST, "train.steps=30", "scheduler.kwargs.T_max=30", "cluster.pipeline_stages=3")
    want = reference_sha(tmp_path, *sets[:-1])
    got = {}
    for k, w in ((2, 1), (2, 3), (3, 1), (3, 3)):
        r = run_up(tmp_path / f"k{k}w{w}", *sets, f"cluster.shards={k}", f"cluster.workers={w}")
        assert r.rc == 0, r.stderr[-3000:]
        got[(k, w)] = r.summary["params_sha256"]
        # (a duplicate: a lease also handed to an idle worker, computed twice; the first copy won)
        assert set(r.summary["dropped_messages"]) <= {"duplicate", "stale_step"}, r.summary
    assert set(got.values()) == {want}, got
    s = r.summary  # K = 3: the leader holds nothing, so the shards carry every gradient byte
    assert s["shards"][0]["bytes_received"] < 0.05 * s["bytes_received"], s["shards"]
    resnet = str(ROOT / "examples" / "resnet.yaml")
    rsets = ("train.steps=12", "scheduler.kwargs.T_max=12", "cluster.spare_workers=0", "checkpoint.every_steps=0",
             "eval.fn=null")
    out = tmp_path / "resnet-reference.json"
    proc = subprocess.run(cmemi_cmd("reference", resnet, *[a for s in rsets for a in ("--set", s)], "--out", str(out)),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = run_up(tmp_path / "resnet", *rsets, "cluster.shards=3", "cluster.pipeline_stages=2", "cluster.workers=2",
               config=resnet)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary["params_sha256"] == json.loads(out.read_text())["params_sha256"]
