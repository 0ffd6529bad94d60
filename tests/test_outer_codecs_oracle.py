"""The outer-change codecs (int4, int2, sparse2 with its per-replica residual) against an independent oracle.

tests/test_diloco_oracle.py writes DiLoCo and Streaming DiLoCo again in plain torch; here each replica's change goes
through the codec written again too, from its definition, without the product's code: per chunk of c values the
absmax a, q = round(x · L / a) clamped to [-L, L], sent as q · (a / L) (int4: L = 7, int2: L = 1); sparse2: per chunk
the k = ceil(ratio · c) largest magnitudes (ties to the lowest position, by a Python sort), each rounded to one of
±a/3, ±a (a their absmax), and error feedback: replica r sends e = Δ + res_r, res_r becomes e − sent, kept per replica
(by parameter, across rounds and, streaming, across the fragments). `cmemi reference` must give the oracle's
parameters bitwise. Tensors under compression.min_compress_numel go as they are.

One-line bugs each of these catches (tried once, reverted): the residual not added (`feedback_step`: e = Δ), the
residual not kept (`LocalRound.with_feedback` starting from zeros every round), sparse2's decoder dividing the scale
by 2 instead of 3, int4's L taken as 8.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_diloco_oracle import Code, assert_bitwise, diloco, initial, reference, settings, streaming

MIN_NUMEL, LOWBIT_CHUNK, SPARSE_CHUNK, RATIO = 256, 100, 300, 0.02  # chunks with remainders: 2048 = 20·100 + 48


def lowbit(x: torch.Tensor, L: int) -> torch.Tensor:
    flat, out = x.reshape(-1), torch.empty(x.numel())
    for lo in range(0, flat.numel(), LOWBIT_CHUNK):
        ch = flat[lo: lo + LOWBIT_CHUNK]
        a = ch.abs().max()
        out[lo: lo + ch.numel()] = (ch * (L / a)).round().clamp(-L, L) * (a / L) if a > 0 else 0.0
    return out.view(x.shape)


def sparse2(x: torch.Tensor) -> torch.Tensor:
    flat, out = x.reshape(-1), torch.zeros(x.numel())
    for lo in range(0, flat.numel(), SPARSE_CHUNK):
        ch = flat[lo: lo + SPARSE_CHUNK]
        k = min(ch.numel(), math.ceil(RATIO * ch.numel()))
        mags = ch.abs().tolist()
        keep = sorted(sorted(range(len(mags)), key=lambda i: (-mags[i], i))[:k])
        v = ch[keep]
        a = v.abs().max()
        if a > 0:
            code = (v * (3.0 / a) + 3.0).div(2.0).round().clamp(0, 3)
            out[[lo + i for i in keep]] = (code * 2.0 - 3.0) * (a / 3.0)
    return out.view(x.shape)


def coder(codec: str) -> Code:
    """What the servers get of replica r's change; sparse2 keeps each replica's residual here."""
    residuals: dict[int, dict[str, torch.Tensor]] = {}

    def code(r: int, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for n, d in delta.items():
            if d.numel() < MIN_NUMEL:
                out[n] = d
            elif codec == "sparse2":
                res = residuals.setdefault(r, {}).get(n, torch.zeros_like(d))
                e = d + res
                out[n] = sparse2(e)
                residuals[r][n] = e - out[n]
            else:
                out[n] = lowbit(d, {"int4": 7, "int2": 1}[codec])
        return out
    return code


def codec_settings(codec: str) -> tuple[str, ...]:
    return (f"compression.codec={codec}", f"compression.min_compress_numel={MIN_NUMEL}",
            f"compression.lowbit_chunk={LOWBIT_CHUNK}", f"compression.sparse_chunk={SPARSE_CHUNK}",
            f"compression.topk_ratio={RATIO}")


@pytest.mark.parametrize("codec", ["int4", "int2", "sparse2"])
def test_whole_rounds_with_outer_codec(codec: str) -> None:
    """R = 4 replicas, 4 rounds of H = 3: `cmemi reference` is DiLoCo with the codec on each change, bitwise; and
    the codec changed the result (else it would be the test of test_diloco_oracle.py again)."""
    H, R, rounds = 3, 4, 4
    got = reference(*settings(H, R, rounds * H), *codec_settings(codec))
    assert_bitwise(got, diloco(H, R, rounds, coder(codec)), initial())
    plain = diloco(H, R, rounds)
    assert any(not torch.equal(got[n], plain[n]) for n in got)


@pytest.mark.parametrize("codec", ["int4", "sparse2"])
def test_streaming_with_outer_codec(codec: str) -> None:
    """F = 3 fragments of an H = 6 round, R = 3, 12 segments, α = 0.25: sparse2's residual of a fragment waits, per
    replica, for that fragment's next sync."""
    H, F, R, segments, mix = 6, 3, 3, 12, 0.25
    got = reference(*settings(H, R, segments * (H // F), f"train.fragments={F}", f"train.fragment_mix={mix}"),
                    *codec_settings(codec))
    assert_bitwise(got, streaming(H, F, R, mix, segments, coder(codec)), initial())
