"""The outer-change codecs (int4, int2, sparse2; issue 48) as units (int4 and int2 also as compression.downlink):
error bounds of a round trip, the same bits from any encoder, byte sizes, sparse2's error feedback kept in a
replica's state (moving with it, checked by the leader), and the config's refusals and permissions. Against plain
torch: tests/test_outer_codecs_oracle.py; real clusters: tests/test_outer_codecs_cluster.py."""

from __future__ import annotations

import math

import pytest
import torch
from cmemi.services.aggregator.common.replicas import InnerStates
from cmemi.services.worker.compute.local import LocalRound
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.shared.compression import downlink
from cmemi.shared.compression.lowbit import pack, unpack
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.compression.sparse2 import feedback_step
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import build_model
from cmemi.shared.config.system import CompressionConfig
from cmemi.shared.core import innerstate
from cmemi.shared.core.grid import Partition

from tests.conftest import DIGITS


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def roundtrip(name: str, g: torch.Tensor, **kw: object) -> tuple[torch.Tensor, int]:
    """(decoded, bytes on the wire) of one tensor."""
    c = make_codec(CompressionConfig(codec=name, error_feedback=False, min_compress_numel=0, **kw))  # type: ignore[arg-type]
    info, frames = c.encode({"w": g}, 0)
    assert info["w"]["codec"] == name
    out = c.decode(info, {k: v.clone() for k, v in frames.items()}, shapes={"w": tuple(g.shape)})["w"]
    return out, sum(t.numel() * t.element_size() for t in frames.values())


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_unpack_round_trip(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (1001,), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.numel() == math.ceil(1001 * bits / 8)
    assert torch.equal(unpack(packed, bits, 1001), codes)


@pytest.mark.parametrize("name, L", [("int4", 7), ("int2", 1)])
def test_lowbit_error_is_at_most_half_a_step_of_its_chunk(name: str, L: int) -> None:
    """|x − decoded| ≤ absmax / (2L) per chunk (round to nearest), a chunk's absmax comes back exact, and the bytes are
    bits / 8 per element plus one fp32 scale per chunk (tail included)."""
    g = rand(1000, 13)  # 13,000 = 101 chunks of 128 + 72
    out, nbytes = roundtrip(name, g, lowbit_chunk=128)
    flat, dec = g.reshape(-1), out.reshape(-1)
    for lo in range(0, flat.numel(), 128):
        ch, d = flat[lo: lo + 128], dec[lo: lo + 128]
        amax = ch.abs().max()
        assert float((ch - d).abs().max()) <= float(amax) / (2 * L) * (1 + 1e-6)
        assert float(d.abs().max()) == pytest.approx(float(amax), rel=1e-6)
    bits = {"int4": 4, "int2": 2}[name]
    assert nbytes == math.ceil(13000 * bits / 8) + 4 * math.ceil(13000 / 128)
    zeros, _ = roundtrip(name, torch.zeros(300))
    assert torch.equal(zeros, torch.zeros(300))


@pytest.mark.parametrize(("codec", "L"), [("int4", 7), ("int2", 1)])
def test_a_lowbit_change_is_within_half_a_step_of_its_chunk_and_costs_bits_plus_a_scale_per_chunk(codec: str,
                                                                                                 L: int) -> None:
    """int4/int2 down (lowbit.py through `downlink.codec`, chunks of compression.lowbit_chunk, here 100 with a
    remainder): after a step the mirror is within absmax / (2L) of θ in each chunk of each piece (round to nearest;
    the mirror started at θ_0, so θ − m is what the codec rounded away), the piece below min_compress_numel (b) is
    exact, and the message is bits / 8 per element plus one fp32 scale per chunk."""
    cfg = CompressionConfig(downlink=codec, lowbit_chunk=100, min_compress_numel=100)
    theta = {"w": rand(64, 48), "v": rand(10, 128, seed=1), "b": rand(48, seed=2)}
    start = {n: t.clone() for n, t in theta.items()}
    server = downlink.Mirror(cfg, theta)
    for p in theta.values():
        p.add_(rand(*p.shape, seed=3), alpha=0.01)
    server.advance(theta, 1)
    info, frames = server.change(0)
    assert {n: m["codec"] for n, m in info.items()} == {"w": codec, "v": codec, "b": "raw"}
    assert torch.equal(server.tensors["b"], theta["b"])
    bits = {"int4": 4, "int2": 2}[codec]
    for n in ("w", "v"):
        change, miss = (theta[n] - start[n]).reshape(-1), (theta[n] - server.tensors[n]).reshape(-1)
        for lo in range(0, change.numel(), 100):
            amax = float(change[lo: lo + 100].abs().max())
            assert float(miss[lo: lo + 100].abs().max()) <= amax / (2 * L) * (1 + 1e-5) + 1e-7, (n, lo)
        numel = change.numel()
        assert frames[f"{n}#q"].numel() == -(-numel * bits // 8) and frames[f"{n}#s"].numel() == -(-numel // 100)


def test_sparse2_keeps_the_largest_per_chunk_at_two_bits() -> None:
    """Per chunk of 512 the ceil(2 % · 512) = 11 largest magnitudes (ties to the lowest position), each decoded to one of
    ±a/3, ±a (a: the chunk's absmax, exact), all others zero; bytes: int16 positions, 2-bit codes, a scale per chunk."""
    g = rand(5000)  # 9 chunks of 512 + 392 (k = 8)
    g[600:610] = 10.0  # ties: 10 equal magnitudes in chunk 1 and one larger, so 11 = the 10 tied and the larger
    g[700] = -20.0
    out, nbytes = roundtrip("sparse2", g, sparse_chunk=512, topk_ratio=0.02)
    ks = [11] * 9 + [8]
    for i, k in enumerate(ks):
        ch, d = g[i * 512:(i + 1) * 512], out[i * 512:(i + 1) * 512]
        kept = d.nonzero().squeeze(1)
        assert kept.numel() == k
        top = torch.sort(ch.abs(), descending=True, stable=True).indices[:k].sort().values
        assert torch.equal(kept, top)
        a = ch[top].abs().max()
        levels = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0]) * a
        assert all(bool(torch.isclose(levels, v, rtol=1e-6).any()) for v in d[kept])
    assert torch.equal(out[600:610], torch.full((10,), 20.0) / 3) and float(out[700]) == -20.0
    total = sum(ks)
    assert nbytes == 2 * total + math.ceil(total / 4) + 4 * 10


@pytest.mark.parametrize("name", ["int4", "int2", "sparse2"])
def test_the_encoding_is_a_pure_function_of_the_input(name: str) -> None:
    """Two codecs, threads 1 and 4, a copy and a non-contiguous view: the same frames, byte for byte."""
    g = rand(300, 257)
    cfg = CompressionConfig(codec=name, error_feedback=False, min_compress_numel=0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = make_codec(cfg).encode({"w": g}, 0)[1]
        torch.set_num_threads(4)
        four = make_codec(cfg).encode({"w": g.T.contiguous().T.clone()}, 3)[1]
    finally:
        torch.set_num_threads(threads)
    assert one.keys() == four.keys() and all(torch.equal(one[k], four[k]) for k in one)


def test_feedback_step_sends_the_residual_later() -> None:
    """e = Δ + residual goes out; the residual becomes what e's encoding left behind; summed over steps, what was sent
    plus the final residual is what was meant, exactly (up to float rounding of the sums)."""
    codec = make_codec(CompressionConfig(codec="sparse2", min_compress_numel=0, sparse_chunk=256, topk_ratio=0.02))
    residual = {"w": torch.zeros(4096)}
    meant, sent = torch.zeros(4096), torch.zeros(4096)
    for step in range(20):
        d = rand(4096, seed=step)
        meant += d
        e = feedback_step(codec, {"w": d}, residual, step)
        info, frames = codec.encode(e, step)
        sent += codec.decode(info, frames)["w"]
    assert torch.allclose(sent + residual["w"], meant, atol=1e-4)
    assert float((sent - meant).norm()) < float(meant.norm())  # the residual is smaller than what was meant


def runner_of(cfg) -> MicrobatchRunner:
    return MicrobatchRunner(cfg, build_model(cfg), resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs),
                            resolve(cfg.train.loss, "train.loss"))


def sparse_cfg(*extra: str):
    return load_config(DIGITS, ["train.local_steps=2", "train.replicas=2", "train.steps=20",
                                "compression.codec=sparse2", "compression.min_compress_numel=256",
                                "compression.sparse_chunk=256", *extra])


def test_a_replicas_residual_is_in_its_state_moves_with_it_and_the_leader_checks_it() -> None:
    """sparse2 with local steps: a round's state carries the replica's residual (by parameter, nonzero where a tensor
    was compressed); the same round from that state (through the wire, on another worker's LocalRound) sends the same
    change; the leader takes the state against this model's layout and refuses it without the residual."""
    cfg = sparse_cfg()
    runner = runner_of(cfg)
    a, b = LocalRound(cfg, runner, Partition(runner.params)), LocalRound(cfg, runner_of(cfg), Partition(runner.params))
    _, d0, _, s0 = a.lease(0, 1, 0, None)
    assert set(s0["residual"]) == set(runner.params)
    assert any(float(t.abs().max()) > 0 for t in s0["residual"].values())
    _, one, _, s1 = a.lease(1, 1, 1, innerstate.through_wire(s0))
    _, other, _, _ = b.lease(1, 1, 1, innerstate.through_wire(s0))
    assert all(torch.equal(one[n], other[n]) for n in one)
    _, fresh, _, _ = b.lease(1, 1, 1, None)  # without the residual: another change
    assert any(not torch.equal(one[n], fresh[n]) for n in one)
    store = InnerStates(2)
    store.expect(innerstate.layout_of(cfg, {n: (p.shape, p.dtype) for n, p in runner.params.items()}))
    meta, tensors = innerstate.to_wire(s1)
    assert store.parse(1, meta, tensors)[1] is None
    bare = {k: v for k, v in s1.items() if k != "residual"}
    assert store.parse(1, *innerstate.to_wire(bare)) == (None, "bad_inner")


@pytest.mark.parametrize("sets, field", [
    (("compression.codec=sparse2",), "compression.codec"),  # synchronous: no replica to keep the residual in
    (("train.local_steps=5", "compression.codec=sign"), "compression.codec"),  # a residual per worker: still refused
    (("compression.lowbit_chunk=0",), "compression.lowbit_chunk"),
    (("compression.sparse_chunk=40000",), "compression.sparse_chunk"),
])
def test_refusals(sets: tuple[str, ...], field: str) -> None:
    with pytest.raises(ConfigError, match=f"config field '{field}'"):
        load_config(DIGITS, ["train.steps=300", *sets])


@pytest.mark.parametrize("sets", [
    ("train.local_steps=5", "compression.codec=sparse2"),  # its residual is the replica's: exact
    ("train.local_steps=5", "compression.codec=int4"), ("compression.codec=int2",),  # stateless: anywhere
    ("compression.codec=sparse2", "compression.error_feedback=false"),  # no residual: stateless
])
def test_what_is_allowed(sets: tuple[str, ...]) -> None:
    assert load_config(DIGITS, ["train.steps=300", *sets]).compression.codec in ("sparse2", "int4", "int2")
