"""Gradient codecs: error bounds, determinism, error feedback, state, hostile input, ratios, convergence."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from cmemi.shared.compression import dense, topk
from cmemi.shared.compression.base import CodecError, GradientCodec, all_finite
from cmemi.shared.compression.registry import make_codec
from cmemi.shared.compression.sizes import ratio, wire_bytes
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.system import CODECS, CompressionConfig
from cmemi.shared.wire import protocol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

STATELESS = ("none", "fp16", "bf16", "int8")
FEW_BITS = ("int4", "int2", "sparse2")  # deterministic too, but too lossy for the closeness checks of STATELESS


def codec(name: str, **kw) -> GradientCodec:
    """The codec, with `none` in its tensor-by-tensor form (its flat form: the test_flat_* tests)."""
    return make_codec(CompressionConfig(codec=name, **kw), **({"flat": False} if name == "none" else {}))


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def roundtrip(c: GradientCodec, grads: dict[str, torch.Tensor], step: int = 0) -> dict[str, torch.Tensor]:
    info, frames = c.encode(grads, step)
    return c.decode(info, frames, {n: tuple(g.shape) for n, g in grads.items()})


def same_frames(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("field, value", [
    ("codec", "gzip"), ("topk_ratio", 0.0), ("topk_ratio", 1.5), ("powersgd_rank", 0), ("int8_chunk", 0),
    ("min_compress_numel", -1), ("warmup_steps", -2),
])
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"config field 'compression.{field}' = {value!r}: .*; "):
        CompressionConfig(**{field: value})


def test_config_defaults_and_factory() -> None:
    cfg = CompressionConfig()
    assert (cfg.codec, cfg.topk_ratio, cfg.powersgd_rank, cfg.int8_chunk) == ("none", 0.01, 2, 1024)
    assert (cfg.min_compress_numel, cfg.warmup_steps, cfg.error_feedback) == (1024, 0, True)
    for name in CODECS:
        c = codec(name)
        assert isinstance(c, GradientCodec) and c.name == name
        assert c.deterministic == (name in STATELESS or name in FEW_BITS)
    assert codec("topk", error_feedback=False).deterministic


# ---------------------------------------------------------------- stateless codecs

def test_none_is_exact_and_zero_copy() -> None:
    grads = {"w": rand(64, 64), "b": rand(64, seed=1), "s": torch.tensor(2.5)}
    c = codec("none")
    info, frames = c.encode(grads, 0)
    for n, g in grads.items():
        assert frames[f"{n}#v"] is g  # the gradient itself goes on the wire
    out = c.decode(info, frames)
    assert all(torch.equal(out[n], grads[n]) for n in grads)
    assert wire_bytes(frames) == sum(g.numel() * 4 for g in grads.values())


@pytest.mark.parametrize("name, rel", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
def test_cast_error_bound(name: str, rel: float) -> None:
    g = rand(256, 256) * 10
    out = roundtrip(codec(name), {"w": g})["w"]
    assert out.dtype == torch.float32 and out.shape == g.shape
    assert bool(((out - g).abs() <= rel * g.abs() + 1e-30).all())


def test_fp16_overflow_goes_dense() -> None:
    g = rand(64, 64)
    g[3, 3] = 1e6  # beyond fp16's 65504
    c = codec("fp16")
    info, frames = c.encode({"w": g}, 0)
    assert info["w"]["codec"] == "raw"
    assert torch.equal(c.decode(info, frames)["w"], g)


@pytest.mark.parametrize("numel, chunk", [(1 << 16, 1024), (5000, 1024), (3000, 7), (2048, 4096)])
def test_int8_error_bound(numel: int, chunk: int) -> None:
    g = rand(numel) * torch.linspace(0.001, 100, numel)  # very different scales per chunk
    c = codec("int8", int8_chunk=chunk)
    info, frames = c.encode({"w": g}, 0)
    assert info["w"]["codec"] == "int8" and info["w"]["chunk"] == chunk
    assert frames["w#q"].dtype == torch.int8 and frames["w#s"].numel() == math.ceil(numel / chunk)
    out = c.decode(info, frames)["w"]
    scale = frames["w#s"].repeat_interleave(chunk)[:numel]
    assert bool(((out - g).abs() <= scale * 0.5 * (1 + 1e-5) + 1e-30).all())


@pytest.mark.parametrize("name", [*STATELESS, *FEW_BITS, "topk-noef", "sign-noef"])
def test_stateless_codecs_are_deterministic(name: str) -> None:
    kw = {"error_feedback": False} if name.endswith("-noef") else {}
    name = name.split("-")[0]
    grads = {"w": rand(300, 200), "b": rand(200, seed=1), "c": rand(8, 3, 5, 5, seed=2)}
    a, b = codec(name, min_compress_numel=64, **kw), codec(name, min_compress_numel=64, **kw)
    info1, frames1 = a.encode(grads, 5)
    info2, frames2 = a.encode({n: g.clone() for n, g in grads.items()}, 6)
    info3, frames3 = b.encode(grads, 7)
    assert info1 == info2 == info3
    assert same_frames(frames1, frames2) and same_frames(frames1, frames3)
    assert a.state_dict() == {}


def test_non_contiguous_and_non_float32_gradients() -> None:
    g = rand(128, 96).T  # non-contiguous view
    for name in CODECS:
        c = codec(name, min_compress_numel=16, topk_ratio=0.5, powersgd_rank=200)  # topk/psgd: goes dense
        out = roundtrip(c, {"w": g, "d": g.double(), "h": g.half()})
        if name in ("sign", *FEW_BITS):  # a few bits: the same as the contiguous fp32 gradient's
            want = roundtrip(codec(name, min_compress_numel=16, topk_ratio=0.5),
                             {"w": g.contiguous(), "h": g.half().float()})
            assert torch.equal(out["w"], want["w"]) and torch.equal(out["d"], want["w"]), name
            assert torch.equal(out["h"], want["h"]), name
            continue
        assert torch.allclose(out["w"], g, atol=0.05, rtol=0.01), name
        assert torch.allclose(out["d"], g, atol=0.05, rtol=0.01), name
        assert torch.allclose(out["h"], g.half().float(), atol=0.05, rtol=0.01), name
        assert all(t.dtype == torch.float32 for t in out.values())


@pytest.mark.parametrize("name", CODECS)
def test_zero_empty_tiny_scalar_and_low_precision_tensors(name: str) -> None:
    grads = {"zeros": torch.zeros(64, 64), "empty": torch.zeros(0, 5), "empty2": torch.zeros(7, 0),
             "tiny": torch.tensor([1e-30, -1e-30, 3.0]), "scalar": torch.tensor(-2.0),
             "bf16": rand(40, 40).bfloat16(), "f64": rand(40, 40, seed=3).double(), "vec": rand(100, seed=4)}
    c = codec(name, min_compress_numel=0)
    for step in range(3):
        out = roundtrip(c, grads, step)
        assert out.keys() == grads.keys()
        for n, g in grads.items():
            assert out[n].dtype == torch.float32 and out[n].shape == g.shape, n
            assert bool(torch.isfinite(out[n]).all()), n
        assert torch.equal(out["zeros"], torch.zeros(64, 64))
        assert out["empty"].numel() == 0 and out["empty2"].numel() == 0
    if name in STATELESS:
        assert torch.allclose(out["tiny"], grads["tiny"], rtol=0.01, atol=1e-6)
        assert torch.allclose(out["f64"], grads["f64"].float(), rtol=0.01, atol=0.02)


# ---------------------------------------------------------------- topk

def reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |x|; among equal magnitudes the lowest indices (a stable sort keeps index order)."""
    order = torch.sort(x.abs().reshape(-1), descending=True, stable=True).indices
    return order[:k].sort().values


@pytest.mark.parametrize("shape", [(512, 512), (1000, 700), (4096,), (96, 32)])
def test_topk_keeps_exactly_the_k_largest(shape: tuple[int, ...]) -> None:
    g = rand(*shape)
    n = g.numel()
    k = max(1, math.ceil(0.01 * n))
    c = codec("topk", min_compress_numel=1, error_feedback=False)
    info, frames = c.encode({"w": g}, 0)
    assert info["w"]["k"] == k and frames["w#v"].shape == (k,) and frames["w#i"].dtype == torch.int32
    assert torch.equal(frames["w#i"].long(), reference_topk(g, k))
    out = c.decode(info, frames)["w"]
    assert int(torch.count_nonzero(out)) == k
    kept = out != 0
    assert torch.equal(out[kept], g[kept])


@pytest.mark.parametrize("n", [5000, 1 << 19])  # small: direct topk; big: sampled-threshold path
def test_topk_ties_go_to_the_lowest_index(n: int) -> None:
    g = (rand(n) * 4).round() / 4  # few distinct magnitudes: many ties at the threshold
    k = math.ceil(0.01 * n)
    c = codec("topk", min_compress_numel=1, error_feedback=False)
    _, frames = c.encode({"w": g}, 0)
    assert torch.equal(frames["w#i"].long(), reference_topk(g, k))
    ones = torch.ones(n)
    _, frames = c.encode({"w": ones}, 0)
    assert torch.equal(frames["w#i"].long(), torch.arange(k))


def _layouts(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    stride = n // topk.SAMPLE  # the topk threshold is estimated from a[::stride]
    off_grid = torch.rand(n, generator=gen) * 1e-3
    off_grid[1::stride] += 10 * torch.rand(n // stride, generator=gen)  # big values between sampled positions
    on_grid = torch.rand(n, generator=gen) * 1e-3
    on_grid[::stride] += 10  # the sample sees only big values: threshold too high, exact fallback
    sparse = torch.zeros(n)
    sparse[torch.randperm(n, generator=gen)[:100]] = 1 + torch.rand(100, generator=gen)  # fewer than k nonzeros
    return {"off_grid": off_grid, "on_grid": -on_grid, "sparse": sparse}


@pytest.mark.parametrize("layout", ["off_grid", "on_grid", "sparse"])
def test_topk_is_exact_on_adversarial_layouts(layout: str) -> None:
    g = _layouts(1 << 19)[layout]
    k = math.ceil(0.01 * g.numel())
    _, frames = codec("topk", error_feedback=False).encode({"w": g}, 0)
    assert torch.equal(frames["w#i"].long(), reference_topk(g, k))


def ef_run(name: str, error_feedback: bool, steps: int, **kw) -> list[dict]:
    """Feed mean+noise gradients through a worker codec; track sum of decoded vs sum of true gradients."""
    worker = codec(name, error_feedback=error_feedback, **kw)
    server = codec(name, **kw)
    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(64, 64, generator=gen)
    true_sum, dec_sum = torch.zeros(64, 64), torch.zeros(64, 64)
    log = []
    for t in range(steps):
        g = mu + torch.randn(64, 64, generator=gen)
        info, frames = worker.encode({"w": g}, t)
        true_sum += g
        dec_sum += server.decode(info, frames)["w"]
        res = worker.state_dict().get("err/w", torch.zeros(64 * 64)).view(64, 64)
        log.append({"rel": float((dec_sum - true_sum).norm() / true_sum.norm()), "res": float(res.norm()),
                    "conservation": float((dec_sum + res - true_sum).norm() / true_sum.norm())})
    return log


@pytest.mark.parametrize("name, kw", [("topk", {"topk_ratio": 0.01}), ("powersgd", {"powersgd_rank": 2}),
                                      ("sign", {"int8_chunk": 256})])
def test_error_feedback_sum_converges_and_residual_stays_bounded(name: str, kw: dict) -> None:
    log = ef_run(name, True, 400, **kw)
    # nothing is lost: what was not sent is exactly the residual
    assert max(e["conservation"] for e in log) < 1e-5
    # the residual plateaus, so the relative error of the running sum falls like 1/T. sign's grows, but slower than
    # the sum: an element whose mean is above its chunk's mean magnitude gets more each step than one sign carries
    # until its residual lifts that magnitude (here like sqrt(T))
    if name == "sign":
        assert log[399]["res"] < 2.5 * log[99]["res"]
    else:
        assert log[399]["res"] < 1.2 * max(e["res"] for e in log[100:200])
    assert log[399]["rel"] < 0.15 and log[399]["rel"] < 0.6 * log[99]["rel"]
    # without error feedback most of the gradient is simply lost (sign: its bias stays, 40 % of the sum here)
    assert ef_run(name, False, 100, **kw)[-1]["rel"] > (0.3 if name == "sign" else 0.8)


def test_topk_error_feedback_state_is_per_tensor() -> None:
    c = codec("topk", min_compress_numel=1)
    g = {"a": rand(2000), "b": rand(50, 40, seed=1), "small": rand(1, seed=2)}
    c.encode(g, 0)
    sd = c.state_dict()
    assert set(sd) == {"err/a", "err/b"}  # "small" goes dense (2k >= numel): no residual
    assert int(torch.count_nonzero(sd["err/a"])) == 2000 - 20


# ---------------------------------------------------------------- powersgd

def test_powersgd_shapes_and_dense_fallbacks() -> None:
    c = codec("powersgd", min_compress_numel=100, powersgd_rank=4)
    grads = {"conv": rand(16, 8, 3, 3), "vec": rand(5000, seed=1), "small": rand(8, 8, seed=2),
             "thin": rand(2, 1000, seed=3), "w": rand(300, 200, seed=4)}
    info, frames = c.encode(grads, 0)
    assert info["conv"] == {"codec": "powersgd", "shape": [16, 8, 3, 3], "dtype": "float32", "rank": 4}
    assert frames["conv#p"].shape == (16, 4) and frames["conv#q"].shape == (4, 72)
    assert frames["w#p"].shape == (300, 4) and frames["w#q"].shape == (4, 200)
    assert [info[n]["codec"] for n in ("vec", "small", "thin")] == ["raw"] * 3  # 1-D, small, no savings
    p = frames["w#p"]
    assert torch.allclose(p.T @ p, torch.eye(4), atol=1e-5)  # orthonormal P
    out = c.decode(info, frames)
    assert all(out[n].shape == g.shape for n, g in grads.items())
    assert torch.equal(out["vec"], grads["vec"])


def test_powersgd_rank_is_clipped_and_low_rank_gradients_are_exact() -> None:
    a, b = rand(200, 2), rand(2, 150, seed=1)
    c = codec("powersgd", powersgd_rank=2, min_compress_numel=1)
    out = roundtrip(c, {"w": a @ b})["w"]
    assert torch.allclose(out, a @ b, atol=1e-4)  # one power iteration recovers a rank-2 matrix
    c = codec("powersgd", powersgd_rank=50, min_compress_numel=1)
    info, frames = c.encode({"w": rand(10, 400), "v": rand(60, 400, seed=1)}, 0)
    assert info["w"]["codec"] == "raw"  # rank clipped to 10 = rows: P and Q would not be smaller
    assert info["v"]["rank"] == 50 and frames["v#p"].shape == (60, 50) and frames["v#q"].shape == (50, 400)
    assert c.decode(info, frames)["v"].shape == (60, 400)


def test_powersgd_warm_start_improves_the_approximation() -> None:
    g = rand(256, 6) @ rand(6, 256, seed=1) + 0.01 * rand(256, 256, seed=2)  # ~rank 6, sent at rank 2
    c = codec("powersgd", error_feedback=False, min_compress_numel=1)
    errors = [float((roundtrip(c, {"w": g}, t)["w"] - g).norm() / g.norm()) for t in range(6)]
    assert errors[-1] < errors[0]
    assert codec("powersgd").state_dict() == {}
    assert set(c.state_dict()) == {"q/w"}  # without error feedback only the warm-start Q is kept


# ---------------------------------------------------------------- state, warmup, non-finite

@pytest.mark.parametrize("name", ["topk", "powersgd", "sign"])
def test_state_dict_load_and_reset(name: str) -> None:
    a = codec(name, min_compress_numel=1)
    grads = [{"w": rand(128, 64, seed=s), "b": rand(64, seed=100 + s)} for s in range(5)]
    for t in range(3):
        a.encode(grads[t], t)
    sd = a.state_dict()
    assert sd and all(k.startswith(("err/", "q/")) for k in sd)
    b = codec(name, min_compress_numel=1)
    b.load_state_dict(sd)
    assert same_frames(a.encode(grads[3], 3)[1], b.encode(grads[3], 3)[1])  # loaded state is a copy
    a.reset()
    assert a.state_dict() == {}
    assert same_frames(a.encode(grads[4], 4)[1], codec(name, min_compress_numel=1).encode(grads[4], 4)[1])
    with pytest.raises(CodecError, match="bad_state"):
        b.load_state_dict({"bogus/w": torch.zeros(3)})
    with pytest.raises(CodecError, match="bad_state"):
        b.load_state_dict({"err/w": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(CodecError, match="bad_state"):
        codec("int8").load_state_dict({"err/w": torch.zeros(3)})
    codec("int8").load_state_dict({})


@pytest.mark.parametrize("name", CODECS)
def test_warmup_steps_send_dense(name: str) -> None:
    c = codec(name, warmup_steps=3)
    g = {"w": rand(128, 128)}
    for t in range(3):
        info, frames = c.encode(g, t)
        assert info["w"]["codec"] == "raw" and frames["w#v"].dtype == torch.float32
        assert torch.equal(c.decode(info, frames)["w"], g["w"])
    assert c.state_dict() == {}
    info, _ = c.encode(g, 3)
    assert info["w"]["codec"] == ("raw" if name == "none" else name)


@pytest.mark.parametrize("numel, chunk", [(5000, 1024), (3001, 7), (2048, 4096), (1 << 16, 1024)])
def test_sign_sends_one_bit_per_element_and_a_mean_magnitude_per_chunk(numel: int, chunk: int) -> None:
    """Decode is exactly scale * (+1 or -1) with the element's own sign (0 counts as +) and the chunk's mean |x| as
    the scale: bit j of byte i is element 8i + j, the last byte's spare bits are ignored, a chunk of zeros is zeros."""
    g = rand(numel, seed=numel)
    zeros = chunk if numel > chunk + 3 else 0
    g[:zeros] = 0.0  # a whole chunk of zeros
    g[zeros + 3] = 0.0
    info, frames = codec("sign", int8_chunk=chunk, error_feedback=False).encode({"w": g}, 0)
    assert info["w"] == {"codec": "sign", "shape": [numel], "dtype": "float32", "chunk": chunk}
    assert frames["w#b"].dtype == torch.uint8 and frames["w#b"].numel() == math.ceil(numel / 8)
    scales = torch.stack([c.abs().mean() for c in g.split(chunk)])
    assert torch.equal(frames["w#s"], scales)
    bits = torch.tensor([(int(frames["w#b"][i // 8]) >> (i % 8)) & 1 for i in range(numel)], dtype=torch.bool)
    assert torch.equal(bits, g >= 0)
    out = codec("sign").decode(info, frames)["w"]
    expect = torch.where(g >= 0, 1.0, -1.0) * scales.repeat_interleave(chunk)[:numel]
    assert torch.equal(out, expect)
    assert not out[:zeros].any() and out[zeros + 3] == scales[1 if zeros else 0]
    # with error feedback the residual is exactly what the signs did not carry, and sign(-0.0) == sign(+0.0)
    ef = codec("sign", int8_chunk=chunk)
    dec = roundtrip(ef, {"w": g})["w"]
    assert torch.equal(ef.state_dict()["err/w"], g - dec)
    assert torch.equal(roundtrip(codec("sign"), {"w": torch.zeros(4096).neg()})["w"], torch.zeros(4096))


def test_dense_path_flushes_a_loaded_residual() -> None:
    c = codec("topk", warmup_steps=1)
    c.load_state_dict({"err/w": torch.ones(64 * 64)})
    out = roundtrip(c, {"w": torch.zeros(64, 64)}, 0)["w"]
    assert torch.equal(out, torch.ones(64, 64)) and c.state_dict() == {}


@pytest.mark.parametrize("name", CODECS)
def test_non_finite_gradients_are_rejected_and_do_not_poison_state(name: str) -> None:
    c = codec(name, min_compress_numel=1)
    good = rand(64, 64)
    c.encode({"w": good}, 0)
    for bad_value in (float("nan"), float("inf")):
        bad = good.clone()
        bad[5, 7] = bad_value
        info, frames = c.encode({"w": bad}, 1)
        with pytest.raises(CodecError, match="nonfinite"):
            c.decode(info, frames)
        assert not any(k.endswith("/w") and k.startswith("err/") for k in c.state_dict())
        passed = make_codec(CompressionConfig(codec=name), check_finite=False,
                            **({"flat": False} if name == "none" else {})).decode(info, frames)["w"]
        assert not bool(torch.isfinite(passed).all())
    out = roundtrip(c, {"w": good}, 2)["w"]
    assert bool(torch.isfinite(out).all())


# ---------------------------------------------------------------- hostile decode input

def valid(name: str) -> tuple[GradientCodec, dict, dict]:
    c = codec(name, min_compress_numel=64)
    info, frames = c.encode({"w": rand(96, 64), "b": rand(8, seed=1)}, 0)
    return c, info, frames


SHAPES = {"w": (96, 64), "b": (8,)}


def hostile_cases(name: str):
    """(label, info mutator, frames mutator, expected reason) for codec `name`."""
    parts = {"none": ["v"], "fp16": ["v"], "bf16": ["v"], "int8": ["q", "s"], "topk": ["v", "i"],
             "powersgd": ["p", "q"], "sign": ["b", "s"], "int4": ["q", "s"], "int2": ["q", "s"],
             "sparse2": ["i", "q", "s"]}[name]
    yield "unknown codec", lambda i: i["w"].update(codec="zip"), None, "unknown_codec"
    yield "codec not a str", lambda i: i["w"].update(codec=3), None, "unknown_codec"
    yield "wrong shape", lambda i: i["w"].update(shape=[64, 96]), None, "bad_shape"
    yield "negative dim", lambda i: i["w"].update(shape=[-96, -64]), None, "bad_shape"
    yield "bool dim", lambda i: i["w"].update(shape=[True, 64]), None, "bad_shape"
    yield "shape not a list", lambda i: i["w"].update(shape="96x64"), None, "bad_shape"
    yield "bad dtype", lambda i: i["w"].update(dtype="int64"), None, "bad_dtype"
    yield "meta not a map", lambda i: i.update(w=[1, 2]), None, "bad_info"
    yield "unknown name", lambda i: i.update(x=i.pop("b")), None, "bad_names"
    yield "missing name", lambda i: i.pop("b"), None, "bad_names"
    yield "missing frame", None, lambda f: f.pop(f"w#{parts[0]}"), "missing_frame"
    yield "frame not a tensor", None, lambda f: f.update({f"w#{parts[-1]}": b"abc"}), "missing_frame"
    yield "extra frame", None, lambda f: f.update({"w#zz": torch.zeros(3)}), "extra_frame"
    yield "truncated", None, lambda f: f.update({f"w#{parts[0]}": f[f"w#{parts[0]}"].reshape(-1)[:-1]}), "bad_size"
    yield "wrong frame dtype", None, lambda f: f.update({f"w#{parts[-1]}": f[f"w#{parts[-1]}"].double()}), "bad_dtype"
    yield "raw truncated", None, lambda f: f.update({"b#v": f["b#v"][:-1]}), "bad_size"
    nan_part = {"int8": "s", "powersgd": "p", "topk": "v", "sign": "s", "int4": "s", "int2": "s",
                "sparse2": "s"}.get(name, "v")
    if name not in ("fp16", "bf16", "none"):
        yield "NaN payload", None, lambda f: f[f"w#{nan_part}"].view(-1).__setitem__(0, float("nan")), "nonfinite"
    yield "NaN raw", None, lambda f: f["b#v"].__setitem__(0, float("nan")), "nonfinite"
    if name in ("fp16", "bf16"):
        yield "inf half", None, lambda f: f["w#v"].view(-1).__setitem__(0, float("inf")), "nonfinite"
    if name == "sign":
        yield "chunk 0", lambda i: i["w"].update(chunk=0), None, "bad_param"
        yield "chunk mismatch", lambda i: i["w"].update(chunk=512), None, "bad_size"
        yield "chunk missing", lambda i: i["w"].pop("chunk"), None, "bad_param"
        yield "chunk float", lambda i: i["w"].update(chunk=1024.0), None, "bad_param"
        yield "bits as int8", None, lambda f: f.update({"w#b": f["w#b"].view(torch.int8)}), "bad_dtype"
        yield "overflowing scale", None, lambda f: f["w#s"].fill_(float("inf")), "nonfinite"
    if name == "int8":
        yield "chunk 0", lambda i: i["w"].update(chunk=0), None, "bad_param"
        yield "chunk mismatch", lambda i: i["w"].update(chunk=512), None, "bad_size"
        yield "chunk missing", lambda i: i["w"].pop("chunk"), None, "bad_param"
        yield "overflowing scale", None, lambda f: f["w#s"].fill_(3e38), "nonfinite"
    if name in ("int4", "int2"):
        yield "chunk 0", lambda i: i["w"].update(chunk=0), None, "bad_param"
        yield "chunk mismatch", lambda i: i["w"].update(chunk=512), None, "bad_size"
        yield "code above the levels", None, lambda f: f["w#q"].fill_(255), "bad_code"
    if name == "sparse2":
        yield "position out of its chunk", None, lambda f: f["w#i"].__setitem__(-1, 5000), "bad_index"
        yield "negative position", None, lambda f: f["w#i"].__setitem__(0, -1), "bad_index"
        yield "duplicate position", None, lambda f: f["w#i"].__setitem__(1, f["w#i"][0]), "bad_index"
        yield "k too big", lambda i: i["w"].update(k=i["w"]["chunk"] + 1), None, "bad_param"
        yield "k mismatch", lambda i: i["w"].update(k=i["w"]["k"] - 1), None, "bad_size"
        yield "chunk above int16", lambda i: i["w"].update(chunk=1 << 16), None, "bad_param"
    if name == "topk":
        yield "index out of range", None, lambda f: f["w#i"].__setitem__(-1, 96 * 64), "bad_index"
        yield "negative index", None, lambda f: f["w#i"].__setitem__(0, -1), "bad_index"
        yield "duplicate index", None, lambda f: f["w#i"].__setitem__(1, f["w#i"][0]), "bad_index"
        yield "unsorted index", None, lambda f: f["w#i"].copy_(f["w#i"].flip(0)), "bad_index"
        yield "k 0", lambda i: i["w"].update(k=0), None, "bad_param"
        yield "k too big", lambda i: i["w"].update(k=96 * 64 + 1), None, "bad_param"
        yield "k bool", lambda i: i["w"].update(k=True), None, "bad_param"
        yield "k mismatch", lambda i: i["w"].update(k=i["w"]["k"] - 1), None, "bad_size"
    if name == "powersgd":
        yield "rank 0", lambda i: i["w"].update(rank=0), None, "bad_param"
        yield "rank too big", lambda i: i["w"].update(rank=65), None, "bad_param"
        yield "rank mismatch", lambda i: i["w"].update(rank=1), None, "bad_size"
        yield "rank str", lambda i: i["w"].update(rank="2"), None, "bad_param"
        yield "overflowing product", None, lambda f: (f["w#p"].fill_(1e20), f["w#q"].fill_(1e20)), "nonfinite"
    if name != "none":
        other = "topk" if name != "topk" else "int8"
        yield "codec mismatch", lambda i: i["w"].update(codec=other), None, "wrong_codec"


CASES = [(name, *case) for name in CODECS for case in hostile_cases(name)]


@pytest.mark.parametrize("name, label, mut_info, mut_frames, reason", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_hostile_decode_input_raises_codec_error(name, label, mut_info, mut_frames, reason) -> None:
    c, info, frames = valid(name)
    info = msgpack.unpackb(msgpack.packb(info))  # as received: fresh, mutable
    frames = {k: v.clone() for k, v in frames.items()}
    if mut_info:
        mut_info(info)
    if mut_frames:
        mut_frames(frames)
    with pytest.raises(CodecError) as err:
        c.decode(info, frames, SHAPES)
    assert err.value.reason == reason, str(err.value)
    assert isinstance(err.value, ValueError) and len(str(err.value)) < 200


def test_hostile_containers_and_huge_shapes() -> None:
    c, info, frames = valid("topk")
    for bad_info, bad_frames, reason in [
        ([1, 2], frames, "bad_info"), ({1: info["w"]}, frames, "bad_info"), (info, [1, 2], "bad_frames"),
    ]:
        with pytest.raises(CodecError, match=reason):
            c.decode(bad_info, bad_frames)
    # a tiny payload claiming a huge tensor: rejected before anything is allocated
    huge = {"w": {**info["w"], "shape": [1 << 20, 1 << 20]}}
    with pytest.raises(CodecError, match="bad_shape"):
        c.decode(huge, {"w#v": frames["w#v"], "w#i": frames["w#i"]})
    with pytest.raises(CodecError, match="bad_shape"):
        c.decode(huge, {"w#v": frames["w#v"], "w#i": frames["w#i"]}, {"w": (96, 64)})
    small = make_codec(CompressionConfig(codec="topk"), max_numel=1000)
    with pytest.raises(CodecError, match="bad_shape"):
        small.decode({"w": info["w"]}, {"w#v": frames["w#v"], "w#i": frames["w#i"]})


_junk = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 40), 1 << 40), st.floats(allow_nan=True),
                  st.text(max_size=8), st.lists(st.integers(-3, 5000), max_size=4),
                  st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["codec", "shape", "dtype", "k", "rank", "chunk", "extra"]), value=_junk,
       part=st.sampled_from(["v", "q", "s", "i", "p", "zz"]),
       frame=st.sampled_from(["keep", "drop", "empty", "int32", "short", "long", "zeros"]))
def test_fuzzed_decode_never_crashes(name: str, key: str, value: object, part: str, frame: str) -> None:
    c, info, frames = valid(name)
    info = msgpack.unpackb(msgpack.packb(info))
    frames = {k: v.clone() for k, v in frames.items()}
    info["w"][key] = value
    fk = f"w#{part}"
    if frame == "drop":
        frames.pop(fk, None)
    elif frame == "empty":
        frames[fk] = torch.zeros(0)
    elif frame == "int32":
        frames[fk] = torch.zeros(4, dtype=torch.int32)
    elif frame == "short" and fk in frames:
        frames[fk] = frames[fk].reshape(-1)[1:]
    elif frame == "long" and fk in frames:
        frames[fk] = torch.cat([frames[fk].reshape(-1), frames[fk].reshape(-1)[:1]])
    elif frame == "zeros" and fk in frames:
        frames[fk] = torch.zeros_like(frames[fk])
    try:
        out = c.decode(info, frames, SHAPES)
    except CodecError:
        return
    assert out.keys() == SHAPES.keys()
    for n, t in out.items():
        assert t.dtype == torch.float32 and tuple(t.shape) == SHAPES[n] and bool(torch.isfinite(t).all())


# ---------------------------------------------------------------- wire, ratios

@pytest.mark.parametrize("name", CODECS)
def test_round_trip_through_the_wire_protocol(name: str) -> None:
    c = codec(name, min_compress_numel=64)
    grads = {"w": rand(96, 64), "b": rand(8, seed=1), "e": torch.zeros(0, 3)}
    info, frames = c.encode(grads, 0)
    parts = protocol.encode("grad", "r", {"wid": "w0", "inc": 1, "term": 1, "step": 0, "lo": 0, "hi": 1, "version": 0,
                                          "losses": [0.0], "n": 8, "codec": info, "finite": True, "encode_s": 0.0}, frames)
    msg = protocol.decode([bytes(p) for p in parts], "r")
    out = c.decode(msg.header["codec"], msg.tensors, {n: g.shape for n, g in grads.items()})
    direct = c.decode(info, frames)
    assert all(torch.equal(out[n], direct[n]) for n in grads)


def test_compression_ratios() -> None:
    grads = {"w": rand(512, 512)}
    for name, at_least in [("none", 0.999), ("fp16", 1.99), ("bf16", 1.99), ("int8", 3.9), ("topk", 10),
                           ("powersgd", 10), ("sign", 30)]:
        info, frames = codec(name).encode(grads, 0)
        r = ratio(grads, frames, info)
        assert r >= at_least, (name, r)
    info, frames = codec("topk").encode(grads, 0)
    assert ratio(grads, frames) == pytest.approx(512 * 512 * 4 / (2622 * 8))
    assert wire_bytes(frames, info) > wire_bytes(frames)


# ---------------------------------------------------------------- convergence

def _task() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g) + 0.5 * torch.sin(2 * x[:, :4])).argmax(1)
    return x[:3072], y[:3072], x[3072:], y[3072:]


def _train(name: str, steps: int = 100, workers: int = 4, mb: int = 32) -> float:
    """Four simulated workers each encode their own microbatch gradient; the server decodes and averages."""
    torch.manual_seed(0)
    xtr, ytr, xte, yte = _task()
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = CompressionConfig(codec=name, min_compress_numel=256)  # both weight matrices compressed
    worker_codecs = [make_codec(cfg) for _ in range(workers)]
    server = make_codec(cfg)
    shapes = {n: p.shape for n, p in params.items()}
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        idx = torch.randint(0, len(xtr), (workers, mb), generator=gen)
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        for w in range(workers):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(xtr[idx[w]]), ytr[idx[w]]).backward()
            info, frames = worker_codecs[w].encode({n: p.grad for n, p in params.items()}, step)
            for n, g in server.decode(msgpack.unpackb(msgpack.packb(info)), frames, shapes).items():
                total[n] += g
        for n, p in params.items():
            p.grad = total[n] / workers
        opt.step()
    with torch.no_grad():
        return float((model(xte).argmax(1) == yte).float().mean())


def test_compressed_training_converges_like_uncompressed() -> None:
    baseline = _train("none")
    assert baseline > 0.85
    for name in CODECS[1:]:
        acc = _train(name)
        assert acc > baseline - 0.04, (name, acc, baseline)


def test_all_finite_is_exact() -> None:
    from cmemi.shared.compression.base import all_finite

    assert all_finite([torch.randn(1000), torch.zeros(0), torch.tensor(3.0)])
    assert all_finite([torch.full((4,), 3e38)])  # finite values whose sum overflows are still finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(1000)
        t[517] = bad
        assert not all_finite([torch.randn(10), t])


def test_flat_none_is_exact_one_frame_and_checks_the_layout() -> None:
    """A small model's gradient travels as one flat fp32 frame in its parameters' layout (shared/wire/layout.py)."""
    grads = {"w": rand(64, 64), "b": rand(64, seed=1), "s": torch.tensor(2.5)}
    shapes = {n: g.shape for n, g in grads.items()}
    c = make_codec(CompressionConfig(codec="none"))
    info, frames = c.encode(grads, 0)
    assert list(frames) == ["flat.float32"] and list(info) == ["*flat"]
    out = c.decode(info, {k: v.clone() for k, v in frames.items()}, shapes=shapes)
    assert list(out) == list(grads) and all(torch.equal(out[n], grads[n]) for n in grads)
    assert make_codec(CompressionConfig(codec="none")).decode(*c.encode(grads, 1), shapes=shapes).keys() == grads.keys()

    def fails(reason: str, info=info, frames=frames, shapes=shapes) -> None:
        with pytest.raises(CodecError) as err:
            make_codec(CompressionConfig(codec="none")).decode(info, frames, shapes=shapes)
        assert err.value.reason == reason, err.value

    fails("bad_layout", shapes={**shapes, "b": (65,)})  # another model
    fails("bad_layout", info={"*flat": {**info["*flat"], "layout": "0" * 16}})
    fails("bad_info", info={**info, "w": {"codec": "raw"}})
    fails("bad_info", shapes=None)
    fails("bad_layout", frames={})
    fails("bad_layout", frames={"flat.float32": frames["flat.float32"][:-16]})
    fails("bad_layout", frames={"flat.float32": frames["flat.float32"].double()})
    fails("bad_layout", frames={**frames, "flat.int64": torch.zeros(3, dtype=torch.int64)})
    fails("bad_frames", frames={"flat.float32": "not a tensor"})
    nan = frames["flat.float32"].clone()
    nan[3] = float("nan")
    fails("nonfinite", frames={"flat.float32": nan})


def test_flat_layout_views_pack_and_alignment() -> None:
    from cmemi.shared.wire.layout import FLAT_MAX_BYTES, Layout

    tensors = {"a": rand(3, 5), "n": torch.arange(7), "b": rand(17), "m": torch.tensor([True, False])}
    layout = Layout(tensors)
    flats = layout.pack(tensors)
    assert sorted(flats) == ["flat.bool", "flat.float32", "flat.int64"]
    views = layout.views(flats)
    assert all(torch.equal(views[n], t) and views[n].dtype == t.dtype for n, t in tensors.items())
    assert all(v.data_ptr() % 64 == 0 for v in views.values())  # every tensor starts on a 64-byte boundary
    assert Layout({"x": torch.empty(FLAT_MAX_BYTES // 4 + 1, device="meta")}).flat is False
    assert Layout(tensors).digest == layout.digest != Layout({**tensors, "b": rand(18)}).digest


def test_flat_pack_zeroes_only_the_padding_and_keeps_every_slice_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pack` writes a fresh buffer once (no zero-fill pass): the tensors' bytes, and zeros between them, whatever
    the allocator handed back; a worker's codec encodes one slice per shard without rebuilding their layouts."""
    from cmemi.shared.wire.layout import Layout

    tensors = {"a": rand(3), "b": rand(5, 7), "n": torch.arange(5), "c": rand(17)}
    layout = Layout(tensors)
    for _ in range(20):  # reuse freed memory full of non-zero bytes
        garbage = [torch.full((4096,), float("nan")) for _ in range(8)]
        del garbage
        flats = layout.pack(tensors)
        covered = {f: torch.zeros(t.numel(), dtype=torch.bool) for f, t in flats.items()}
        for view in layout.views(flats).values():
            frame = Layout.frame_name(view.dtype)
            covered[frame][view.storage_offset():view.storage_offset() + view.numel()] = True
        for f, t in flats.items():
            assert not t[~covered[f]].any(), f"padding of {f} is not zero"
        assert all(torch.equal(v, tensors[n]) for n, v in layout.views(flats).items())
        assert all_finite([flats["flat.float32"]])
    built = []
    monkeypatch.setattr(dense, "Layout", lambda t: built.append(1) or Layout(t))
    c = make_codec(CompressionConfig(codec="none"))
    slices = [{"w": rand(4, 3)}, {"w": rand(2, 3), "b": rand(3)}, {"v": rand(9)}]
    encoded = [c.encode(s, 1) for _ in range(3) for s in slices][-len(slices):]
    assert len(built) == len(slices)  # one layout per slice, kept across steps
    for s, (info, frames) in zip(slices, encoded, strict=True):
        out = c.decode(info, frames, shapes={n: t.shape for n, t in s.items()})
        assert all(torch.equal(out[n], s[n]) for n in s)


def test_every_tag_a_codec_sends_has_a_decoder_and_no_other() -> None:
    """base.TAGS tells "unknown_codec" from "wrong_codec": it must be exactly the tags the registry's codecs send."""
    from cmemi.shared.compression.base import TAGS
    assert TAGS == {"raw"} | {make_codec(CompressionConfig(codec=name)).tag for name in CODECS if name != "none"}
