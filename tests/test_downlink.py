"""Compressed downlink (compression.downlink): the servers send the change of a mirror of the parameters, every
worker applies it with the same function, so the mirror and the result are the same bits for any W, any K, any
fault, and equal to `cmemi reference` (docs/design.md §9)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
import torch
from cmemi.services.worker.links.intake import Intake
from cmemi.shared.compression import downlink
from cmemi.shared.compression.base import CodecError
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import config_from_dict
from cmemi.shared.config.system import CompressionConfig
from cmemi.shared.core.grid import Partition

from tests.conftest import FAST, run_up
from tests.helpers import references
from tests.helpers.chaos import Cluster

CODECS = ["bf16", "int8", "topk", "powersgd", "sign", "int4", "int2"]


def _pieces(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 48, generator=g), "v": torch.randn(10, 128, generator=g),
            "b": torch.randn(48, generator=g)}


def _cfg(codec: str) -> CompressionConfig:
    return CompressionConfig(downlink=codec, topk_ratio=0.05, min_compress_numel=100)


def _step(theta: dict[str, torch.Tensor], t: int) -> None:
    g = torch.Generator().manual_seed(100 + t)
    for p in theta.values():
        p.add_(torch.randn(p.shape, generator=g), alpha=0.01)


def _received(frames: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frames as a worker gets them: other tensors with the same bytes."""
    return {k: torch.frombuffer(bytearray(v.contiguous().view(torch.uint8).numpy().tobytes()), dtype=v.dtype).view(v.shape)
            for k, v in frames.items()}


# ---------------------------------------------------------------------------------------------- unit

@pytest.mark.parametrize("codec", CODECS)
def test_the_servers_mirror_and_a_workers_are_the_same_function_bitwise(codec: str) -> None:
    """The server moves its mirror by what its message decodes to; a worker applies the received bytes with the
    same `apply`: equal bits every step, the mirror follows the parameters (error feedback: m keeps the residual),
    and the message is smaller than the dense change."""
    theta = _pieces()
    start = {n: t.clone() for n, t in theta.items()}
    server = downlink.Mirror(_cfg(codec), theta)
    worker = {n: t.clone() for n, t in theta.items()}
    decoder = downlink.codec(_cfg(codec))
    shapes = {n: tuple(t.shape) for n, t in theta.items()}
    for t in range(1, 9):
        _step(theta, t)
        server.advance(theta, t)
        info, frames = server.change(t - 1)
        assert server.change(t) is None  # from a version before: the change, or a chain of them (below)
        assert t < 2 or (codec == "bf16") == (server.change(t - 2) is None)  # (two bf16 changes: the mirror's size)
        downlink.apply(decoder, worker, info, _received(frames), shapes)
        for n in theta:
            assert torch.equal(worker[n], server.tensors[n]), (codec, t, n)
        sent = sum(f.numel() * f.element_size() for f in frames.values())
        assert sent < sum(p.numel() * 4 for p in theta.values())
    gap = max(float((theta[n] - server.tensors[n]).abs().max()) for n in theta)
    assert gap < 0.2, gap  # what was not sent is sent later: the mirror stays near the parameters
    # ... and it moved with them: a mirror left at θ_0 (a decoder that returns zeros, which the bitwise checks above
    # cannot see: server and worker would agree on it) is as far from θ as θ has drifted, and the 8 steps' drift is
    # under 0.2 everywhere. Measured: ‖θ − m‖ / ‖θ − θ_0‖ = 0.001 (bf16), 0.003 (int8), 0.04 (int4), 0.40 (int2),
    # 0.27 (sign), 0.57 (topk), 0.76 (powersgd, rank 2)
    err = sum(float((theta[n] - server.tensors[n]).norm()) ** 2 for n in theta) ** 0.5
    drift = sum(float((theta[n] - start[n]).norm()) ** 2 for n in theta) ** 0.5
    assert err < 0.85 * drift, (codec, err, drift)


def test_the_downlink_warms_up_with_the_uplink_raw_changes_then_the_codec() -> None:
    """compression.warmup_steps holds for the downlink too (DDP's start_powerSGD_iter): the changes of the first
    steps go raw fp32, so the mirror is the parameters then; after them the codec's own messages."""
    theta = _pieces()
    server = downlink.Mirror(dataclasses.replace(_cfg("powersgd"), warmup_steps=3), theta)
    for t in range(1, 6):
        _step(theta, t)
        server.advance(theta, t)
        info, _ = server.change(t - 1)
        tags = {m["codec"] for m in info.values()}
        assert tags == ({"raw"} if t <= 3 else {"raw", "powersgd"}), (t, tags)  # (b: too small to compress)
        if t <= 3:
            for n in theta:
                torch.testing.assert_close(server.tensors[n], theta[n], rtol=0, atol=1e-6)


def test_a_mirror_restored_from_its_state_goes_on_bitwise() -> None:
    """A checkpoint holds the mirror and PowerSGD's warm-start Q: restored, it sends the same messages."""
    theta = _pieces()
    a = downlink.Mirror(_cfg("powersgd"), theta)
    for t in range(1, 4):
        _step(theta, t)
        a.advance(theta, t)
    b = downlink.Mirror(_cfg("powersgd"), _pieces(seed=1))
    b.load_state_dict({k: {n: v.clone() for n, v in part.items()} for k, part in a.state_dict().items()}, 3)
    assert b.change(2) is None  # a restored server sends the whole mirror first
    for t in range(4, 7):
        _step(theta, t)
        a.advance(theta, t)
        b.advance(theta, t)
        for k in a.deltas[t][1]:
            assert torch.equal(a.deltas[t][1][k], b.deltas[t][1][k]), (t, k)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in theta)


@pytest.mark.parametrize(("codec", "period"), [("int8", 2), ("int4", 4), ("powersgd", 4), ("sign", 4)])  # (4 int8: the
def test_a_worker_versions_behind_gets_the_chain_of_changes_and_the_same_bits(codec: str, period: int) -> None:  # mirror's size)
    """A worker that sat out steps (no lease came its way) gets the changes since its version, oldest first, applied
    one by one as the server did: the same bits as the server's mirror and as a worker that took every change. Too
    far behind (more than KEPT versions), or a chain bigger than the mirror: None, the server sends it whole."""
    theta = _pieces()
    server = downlink.Mirror(_cfg(codec), theta)
    decoder, shapes = downlink.codec(_cfg(codec)), {n: tuple(t.shape) for n, t in theta.items()}
    every, lagging = {n: t.clone() for n, t in theta.items()}, {n: t.clone() for n, t in theta.items()}
    behind = 0
    for t in range(1, 3 * downlink.KEPT):
        _step(theta, t)
        server.advance(theta, t)
        downlink.apply(decoder, every, *(lambda c: (c[0], _received(c[1])))(server.change(t - 1)), shapes)
        if t % period == 0:  # every period-th version the lagging worker comes back: a chain of `period` changes
            info, frames = server.change(behind)
            assert isinstance(info, list) and len(info) == t - behind
            assert all(k.split(downlink.LINK)[0] in {str(i) for i in range(len(info))} for k in frames)
            downlink.apply(decoder, lagging, info, _received(frames), shapes)
            behind = t
            assert all(torch.equal(lagging[n], server.tensors[n]) for n in theta), (codec, t)
        assert all(torch.equal(every[n], server.tensors[n]) for n in theta), (codec, t)
    last = server.version
    # (8 int8 changes: twice the mirror; 8 int4 ones: 8 × 17 / 128 of it)
    assert (server.change(last - downlink.KEPT) is None) == (codec in ("int8", "int4"))
    assert server.change(last - downlink.KEPT - 1) is None
    assert server.change(last) is None and server.change(-1) is None and server.change(True) is None
    dense = downlink.Mirror(CompressionConfig(downlink="bf16", min_compress_numel=10 ** 9), _pieces())
    for t in range(1, 4):  # every piece below min_compress_numel: each change is raw fp32, as big as the mirror
        dense.advance(_pieces(seed=t), t)
    assert dense.change(2) is not None and dense.change(1) is None  # one change always, a chain only when smaller


def test_a_malformed_chain_raises_before_any_piece_changes() -> None:
    theta = _pieces()
    server = downlink.Mirror(_cfg("int8"), theta)
    for t in (1, 2, 3):
        _step(theta, t)
        server.advance(theta, t)
    info, frames = server.change(0)
    worker = {n: t.clone() for n, t in _pieces().items()}
    before = {n: t.clone() for n, t in worker.items()}
    shapes = {n: tuple(t.shape) for n, t in worker.items()}
    last = max(k for k in frames if k.startswith("2|"))
    cases = [("bad_chain", [], {}), ("bad_chain", info * 3, frames), ("bad_chain", info, [1, 2]),
             ("extra_frame", info, {**frames, "3|w#q": torch.zeros(1)}),
             ("extra_frame", info, {**frames, "w#q": torch.zeros(1)}),
             ("extra_frame", info, {**frames, "x|w#q": torch.zeros(1)}),
             ("missing_frame", info, {k: v for k, v in frames.items() if k != last}),
             ("bad_info", [*info[:2], "nonsense"], frames)]
    for reason, i, f in cases:
        with pytest.raises(CodecError) as exc:
            downlink.apply(downlink.codec(_cfg("int8")), worker, i, f, shapes)
        assert exc.value.reason == reason, (reason, str(exc.value))
        assert all(torch.equal(worker[n], before[n]) for n in worker), reason


def _hostile(info: dict, frames: dict[str, torch.Tensor], codec: str = "int8") -> list[tuple[str, dict, dict]]:
    name = next(n for n, m in info.items() if m["codec"] == codec)
    bad_dtype = {**frames, f"{name}#q": frames[f"{name}#q"].float()}
    missing = {k: v for k, v in frames.items() if k != f"{name}#s"}
    nan = {**frames, f"{name}#s": torch.full_like(frames[f"{name}#s"], float("nan"))}
    wrong_shape = {**info, name: {**info[name], "shape": [3, 3]}}
    cases = [("bad_dtype", info, bad_dtype), ("missing_frame", info, missing), ("nonfinite", info, nan),
             ("bad_shape", wrong_shape, frames), ("bad_info", "nonsense", frames),
             ("extra_frame", info, {**frames, "x#v": torch.zeros(1)})]
    if codec in ("int4", "int2"):  # the packed codes: one above 2L (int4: 15 of 0..14), an inf scale, a bad chunk
        top = {**frames, f"{name}#q": torch.full_like(frames[f"{name}#q"], 0xFF)}
        inf = {**frames, f"{name}#s": frames[f"{name}#s"].clone().index_fill_(0, torch.tensor([0]), float("inf"))}
        chunk = {**info, name: {**info[name], "chunk": 0}}
        cases += [("bad_code", info, top), ("nonfinite", info, inf), ("bad_param", chunk, frames)]
    return cases


def _first_change(name: str) -> tuple[downlink.Mirror, dict, dict]:
    """A server's mirror after its first step, and the change it sends."""
    theta = _pieces()
    server = downlink.Mirror(_cfg(name), theta)
    _step(theta, 1)
    server.advance(theta, 1)
    return (server, *server.change(0))


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_malformed_changes_raise_codec_errors_and_leave_the_mirror_as_it_was(codec: str) -> None:
    server, info, frames = _first_change(codec)
    worker = {n: t.clone() for n, t in _pieces().items()}
    before = {n: t.clone() for n, t in worker.items()}
    for reason, i, f in _hostile(info, frames, codec):
        with pytest.raises(CodecError) as exc:
            downlink.apply(downlink.codec(_cfg(codec)), worker, i, f, {n: tuple(t.shape) for n, t in worker.items()})
        assert exc.value.reason == reason
        assert all(torch.equal(worker[n], before[n]) for n in worker), reason


def test_a_worker_counts_a_malformed_change_and_asks_for_the_whole_mirror() -> None:
    """Intake.apply_change (services/worker/links/intake.py): a malformed change, or one from another version, changes nothing and returns False
    (the worker then asks again with no version: the leader sends the whole mirror); a good one moves the model."""
    server, info, frames = _first_change("int8")
    params = {n: t.clone() for n, t in _pieces().items()}
    w = SimpleNamespace(downlink=downlink.codec(_cfg("int8")), version=0, downlink_dropped=0, params=params,
                        partition=Partition(params), step_buffers={},
                        log=structlog.get_logger())
    msg = SimpleNamespace(header={"downlink": "delta", "base": 0, "version": 1}, tensors=dict(frames))
    for reason, i, f in _hostile(info, frames):
        assert not Intake.apply_change(w, SimpleNamespace(header={**msg.header, "codec": i}, tensors=f)), reason
    assert w.downlink_dropped == 6 and w.version == 0
    assert not Intake.apply_change(w, SimpleNamespace(header={**msg.header, "base": 5, "codec": info},
                                                       tensors=frames))
    assert all(torch.equal(params[n], t) for n, t in _pieces().items())
    assert Intake.apply_change(w, SimpleNamespace(header={**msg.header, "codec": info}, tensors=_received(frames)))
    assert w.version == 1 and all(torch.equal(params[n], server.tensors[n]) for n in params)
    theta = {n: t.clone() for n, t in server.tensors.items()}
    for t in (2, 3, 4):  # the worker sits out three steps, then gets their chain
        _step(theta, t)
        server.advance(theta, t)
    info, frames = server.change(1)
    assert isinstance(info, list)
    assert Intake.apply_change(w, SimpleNamespace(header={"downlink": "delta", "base": 1, "version": 4, "codec": info},
                                                   tensors=_received(frames)))
    assert w.version == 4 and all(torch.equal(params[n], server.tensors[n]) for n in params)


def test_config_names_the_field_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"compression.downlink' = 'fp16'.*none, bf16, int8, topk, powersgd"):
        CompressionConfig(downlink="fp16")
    with pytest.raises(ConfigError, match=r"compression.downlink.*cluster.pipeline_stages"):
        config_from_dict({"model": {"factory": "cmemi.examples.digits:make_model"},
                          "data": {"factory": "cmemi.examples.digits:make_dataset"},
                          "cluster": {"shards": 2, "pipeline_stages": 2}, "compression": {"downlink": "int8"}})


# ---------------------------------------------------------------------------------------------- real runs

SHORT = (*FAST[2:], "train.steps=30", "scheduler.kwargs.T_max=30")


def reference(tmp_path: Path, *sets: str) -> dict:
    """`cmemi reference`'s summary, once per config per session (tests/helpers/references.py)."""
    return references.reference(tmp_path, *sets)


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("codec", "runs"), [("powersgd", [(1, 1), (2, 1), (3, 1), (2, 3), (3, 3)]),
                                             ("int8", [(2, 1), (3, 3), (1, 3)]), ("sign", [(2, 1), (3, 2)]),
                                             ("int4", [(3, 2)])])  # (int4 with local steps and a kill: elsewhere)
def test_the_mirror_and_the_result_are_the_same_bits_for_any_w_and_k(tmp_path: Path, codec: str,
                                                                     runs: list[tuple[int, int]]) -> None:
    sets = (*SHORT, f"compression.downlink={codec}", "compression.warmup_steps=3")  # (raw changes, then the codec)
    ref = reference(tmp_path, *sets)
    assert ref["params_sha256"] != reference(tmp_path, *SHORT)["params_sha256"]  # the downlink changes the result
    for w, k in runs:
        r = run_up(tmp_path / f"w{w}k{k}", *sets, f"cluster.workers={w}", f"cluster.shards={k}")
        assert r.rc == 0, r.stderr[-3000:]
        s = r.summary
        assert s["downlink"] == codec and s["steps"] == 30 and s["duplicate_param_sends"] == 0
        # one whole mirror per worker and server at its first pull; after it changes, or chains of them, unless a worker
        # sat out more than downlink.KEPT steps in a row
        assert w * k <= s["mirrors_sent"] < s["changes_sent"], (s["mirrors_sent"], s["changes_sent"])
        assert (s["params_sha256"], s["mirror_sha256"]) == (ref["params_sha256"], ref["mirror_sha256"]), (w, k)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_leader_that_owns_no_piece_sends_changes_workers_apply(tmp_path: Path) -> None:
    """powersgd's grid is whole tensors, so with K = 3 shards of an MLP whose first matrix is most of it the leader
    owns no piece: its `work` carries an empty change, which workers apply from their version like any other (they
    once moved their version first, took the change for another version's and asked for the whole mirror every
    step). No parameters are sent twice, and the result is the reference's."""
    from bench.cluster_models import sleepy_mlp

    kwargs = {"in_dim": 64, "hidden": 512, "depth": 2, "classes": 10, "sleep_ms": 0.0}  # digits' 64 features
    assert Partition(dict(sleepy_mlp(**kwargs).named_parameters()), 3, whole=True).owned(0) == []  # the case
    sets = (*SHORT, "compression.downlink=powersgd", "model.factory=bench.cluster_models:sleepy_mlp",
            "model.kwargs={" + ", ".join(f"{k}: {v}" for k, v in kwargs.items()) + "}")
    ref = reference(tmp_path, *sets)
    r = run_up(tmp_path / "k3", *sets, "cluster.workers=2", "cluster.shards=3")
    assert r.rc == 0, r.stderr[-3000:]
    s = r.summary
    assert s["duplicate_param_sends"] == 0 and s["steps"] == 30
    assert (s["params_sha256"], s["mirror_sha256"]) == (ref["params_sha256"], ref["mirror_sha256"])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_powersgd_downlink_sends_far_fewer_parameter_bytes(tmp_path: Path) -> None:
    """Parameter bytes the leader sent (summary bytes_received: what workers received), per step, one worker:
    every version but the first goes as a change."""
    sent = {}
    for codec in ("none", "powersgd"):
        r = run_up(tmp_path / codec, *SHORT, "cluster.workers=1", f"compression.downlink={codec}")
        assert r.rc == 0, r.stderr[-3000:]
        sent[codec] = r.summary["bytes_received"] / r.summary["steps"]
    assert sent["none"] / sent["powersgd"] >= 8, sent


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(600)
def test_downlink_through_a_killed_worker_and_shard_is_still_the_reference(tmp_path: Path) -> None:
    """K = 3, W = 2, powersgd both ways off (dense uplink: its result does not depend on who computed what) and
    powersgd down: SIGKILL a worker (its replacement gets the whole mirror) and a shard (the cluster rolls back to
    the last checkpoint, whose mirror and warm-start Q it restores); the result is the reference's, bitwise."""
    sets = ("train.steps=400", "scheduler.kwargs.T_max=400", "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1",
            "compression.downlink=powersgd", "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs.pace=0.01")
    ref = reference(tmp_path, *sets, "checkpoint.every_steps=0")
    c = Cluster(tmp_path / "run", *sets, "checkpoint.every_steps=50", "cluster.workers=2", "cluster.shards=3",
                "cluster.spare_workers=0")
    try:
        for target, role, ident in ((100, "worker", "w0"), (200, "aggregator", "1")):
            c.wait_step(target)
            inc = c.signal(role, ident)
            c.replaced(role, ident, inc)
    finally:
        rc = c.wait(timeout=400)
    assert rc == 0, c.output()
    s = c.summary
    assert s["steps"] == 400
    assert (s["params_sha256"], s["mirror_sha256"]) == (ref["params_sha256"], ref["mirror_sha256"])
    events = [json.loads(x) for x in (c.run_dir / "events.jsonl").read_text().splitlines()]
    restored = [e["step"] for e in events if e["kind"] == "checkpoint_restored"]
    assert restored and all(step % 50 == 0 and step > 0 for step in restored), restored
