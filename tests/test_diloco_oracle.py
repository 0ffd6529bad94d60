"""DiLoCo and Streaming DiLoCo against an independent oracle (docs/design.md §10).

Every other local-steps test compares `cmemi up` with `cmemi reference`, and both run the same `LocalRound`
(services/worker/compute/local.py) and the same `Trainer`: a bug in the algorithm itself would pass them all. Here
the algorithm is written again in plain torch from its definition — R replicas, each with its own inner optimizer and
schedule kept from round to round, take H inner steps on microbatch r of the virtual steps t·H + h; the outer step is
Nesterov SGD (lr 0.7, momentum 0.9, DiLoCo's) on the mean of the changes θ_t − θ_r; streaming, segment s syncs
fragment s mod F and merges fragment (s − 2) mod F as α·local + (1 − α)·global — and `cmemi reference` (in process)
must give its parameters bitwise.

Bitwise, not within a tolerance: the oracle does the arithmetic a plain torch loop does, in the order the definition
gives (one forward and backward per microbatch; the changes summed by the balanced tree the design fixes for any sum
over replicas, shared/core/reduction.py, then divided by R; torch's SGD inside and outside, with the fused kernel,
which shared/config/plugins.py picks where torch has one: the per-tensor loop rounds a small tensor's elements
differently, 1 ulp on the last layer's bias after two inner steps), so every float agrees. The product's promise is
the same bits, and an oracle allowed a tolerance would let a wrong mix of two close tensors through. Both tests take
about a second.

Each one-line bug below fails the tests named (each tried once and reverted). The unit tests of test_local_steps.py
and test_fragments.py pass with the merge removed, the mix ignored or swapped, and the sign flipped anywhere but in
`LocalRound.run`:
- the fragment merge in `LocalRound.segment` removed; `fragment_mix` taken as 0, or as 1, or its two weights swapped
  (α = 0.25 here: 0.5 would hide the swap); a fragment merged one segment early: the streaming test (α = 0.25; all
  but "α taken as 0" fail α = 0 too); `fragments.merge`'s α = 0 branch (a copy) skipped: the streaming test at α = 0;
- the outer optimizer's momentum dropped (DiLoCo's defaults in shared/config/schema.py): both tests;
- the outer gradient's sign flipped (`Trainer.apply`): both; Δ = θ_r − θ_t in `LocalRound.run`: the whole-rounds test,
  in `LocalRound.segment`: the streaming test;
- a replica's inner state not carried over, every replica reading microbatch 0, the mean's division by R left out:
  both tests;
- compression.downlink with whole rounds: a round started from θ_t instead of the mirror (`Trainer.wire_state`
  returning the pieces), or a mirror never moved (`Mirror.advance` a no-op): the downlink test (each tried once by
  patching, in-process).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from cmemi.examples.digits import make_dataset, make_model
from cmemi.shared.config.loading import load_config
from cmemi.shared.core.data import microbatch_indices

from cmemi.commands.reference import train
from tests.conftest import DIGITS

SEED, BATCH, HIDDEN, INNER_LR = 0, 24, 32, 0.1
# What the servers receive of replica r's change (tests/test_outer_codecs_oracle.py: a codec written again in plain
# torch, with its residual kept per replica); the identity by default
Code = Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def exact(r: int, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return delta
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer step, CMEMI's default outer_optimizer (Nesterov SGD)


def settings(H: int, R: int, steps: int, *extra: str) -> tuple[str, ...]:
    """The digits example, small: a 32-wide MLP without dropout, no evaluation, the defaults' outer optimizer."""
    return ("run.seed=0", f"model.kwargs={{hidden: {HIDDEN}, dropout: 0.0}}", f"train.global_batch={BATCH}",
            f"optimizer.kwargs={{lr: {INNER_LR}, momentum: 0.9, nesterov: true}}", f"scheduler.kwargs.T_max={steps}",
            f"train.local_steps={H}", f"train.replicas={R}", f"train.steps={steps}", "eval.fn=null",
            "eval.every_steps=0", "cluster.threads_per_worker=1", *extra)


def reference(*sets: str) -> dict[str, torch.Tensor]:
    """`cmemi reference`'s final parameters, trained in this process."""
    threads = torch.get_num_threads()
    try:
        trainer, _ = train(load_config(DIGITS, list(sets)))
    finally:
        torch.set_num_threads(threads)
    assert [p.name for p in trainer.partition.pieces] == list(trainer.params)  # the grid's pieces are the parameters
    return {n: p.detach().clone() for n, p in trainer.params.items()}


# ---------------------------------------------------------------------------------------------- the oracle

class Replica:
    """One replica: its own model (its parameters θ_r), inner optimizer and schedule, kept for the whole run."""

    def __init__(self, steps: int) -> None:
        self.model = make_model(hidden=HIDDEN, dropout=0.0)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=INNER_LR, momentum=0.9, nesterov=True, fused=True)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=steps)
        self.params = dict(self.model.named_parameters())

    def inner_steps(self, first: int, count: int, r: int, R: int) -> None:
        """`count` inner steps on microbatch r of the virtual steps first, first + 1, ... (M = R: a synchronous run's
        samples, split over the replicas)."""
        x_all, y_all = make_dataset().tensors
        for v in range(first, first + count):
            idx = microbatch_indices(SEED, len(y_all), BATCH, R, v, r)
            self.opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(self.model(x_all[idx]), y_all[idx]).backward()
            self.opt.step()
            self.sched.step()


def initial() -> dict[str, torch.Tensor]:
    """θ_0: the model the run's seed builds (leaves the outer optimizer can step)."""
    torch.manual_seed(SEED)
    model = make_model(hidden=HIDDEN, dropout=0.0)
    return {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}


def tree_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """Σ xs bracketed as a balanced binary tree: split after the largest power of two below len(xs)."""
    if len(xs) == 1:
        return xs[0].clone()
    h = 1 << ((len(xs) - 1).bit_length() - 1)
    return tree_sum(xs[:h]).add_(tree_sum(xs[h:]))


def outer_optimizer(theta: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer step over the global parameters: SGD, lr 0.7, Nesterov momentum 0.9."""
    return torch.optim.SGD(theta.values(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True, fused=True)


def outer_step(theta: dict[str, torch.Tensor], outer: torch.optim.Optimizer,
               deltas: list[dict[str, torch.Tensor]]) -> None:
    """One outer step with the mean change as the gradient: g = (Σ_r Δ_r) / R, Δ_r = θ − θ_r, the pseudo-gradient
    (θ − lr·(g + μ·b) moves towards the replicas). Parameters without a change (streaming: not the step's fragment)
    get no gradient, so SGD leaves them and their momentum alone."""
    for n in deltas[0]:
        theta[n].grad = tree_sum([d[n] for d in deltas]).div_(len(deltas))
    outer.step()
    outer.zero_grad(set_to_none=True)


def diloco(H: int, R: int, rounds: int, code: Code = exact,
           down: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """DiLoCo: every round, each replica from θ_t takes H inner steps; the outer step takes θ_t to θ_{t+1}. `down` (a
    downlink codec, DoubleSqueeze's): the replicas start from a mirror m_t instead, m_0 = θ_0 and after each outer
    step m_{t+1} = m_t + down(θ_{t+1} − m_t); Δ_r = m_t − θ_r, and the outer step still moves θ."""
    theta = initial()
    outer = outer_optimizer(theta)
    replicas = [Replica(rounds * H) for _ in range(R)]
    mirror = {n: t.detach().clone() for n, t in theta.items()}
    for t in range(rounds):
        start = theta if down is None else mirror
        deltas = []
        for r, rep in enumerate(replicas):
            with torch.no_grad():
                for n, p in rep.params.items():
                    p.copy_(start[n])
            rep.inner_steps(t * H, H, r, R)
            deltas.append(code(r, {n: start[n].detach() - p.detach() for n, p in rep.params.items()}))
        outer_step(theta, outer, deltas)
        if down is not None:
            for n, m in mirror.items():
                m.add_(down(theta[n].detach() - m))
    return {n: p.detach() for n, p in theta.items()}


def cut(theta: dict[str, torch.Tensor], F: int) -> list[list[str]]:
    """F contiguous runs of the parameters with about equal bytes: a fragment ends at the first parameter whose running
    total reaches its share."""
    total, done, out = sum(t.numel() for t in theta.values()), 0, [[]]
    for n, t in theta.items():
        if out[-1] and done >= len(out) * total / F:
            out.append([])
        out[-1].append(n)
        done += t.numel()
    assert len(out) == F and all(out), out
    return out


def streaming(H: int, F: int, R: int, mix: float, segments: int, code: Code = exact) -> dict[str, torch.Tensor]:
    """Streaming DiLoCo: segment s is H/F inner steps of each replica, whose own θ_r carries on; it first merges
    global fragment (s − 2) mod F into θ_r, and ends sending the change of fragment s mod F, which the outer step
    (step s) moves alone."""
    theta, L = initial(), H // F
    outer = outer_optimizer(theta)
    fragments = cut(theta, F)
    replicas = [Replica(segments * L) for _ in range(R)]
    for rep in replicas:
        with torch.no_grad():
            for n, p in rep.params.items():
                p.copy_(theta[n])
    for s in range(segments):
        deltas = []
        for r, rep in enumerate(replicas):
            if s >= 2:
                with torch.no_grad():
                    for n in fragments[(s - 2) % F]:
                        rep.params[n].mul_(mix).add_(theta[n], alpha=1 - mix)
            rep.inner_steps(s * L, L, r, R)
            deltas.append(code(r, {n: theta[n].detach() - rep.params[n].detach() for n in fragments[s % F]}))
        outer_step(theta, outer, deltas)
    return {n: p.detach() for n, p in theta.items()}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert all(not torch.equal(want[n], start[n]) for n in want)  # every parameter trained
    diff = {n: float((got[n] - want[n]).abs().max()) for n in want if not torch.equal(got[n], want[n])}
    assert not diff, f"cmemi reference differs from the oracle (max |difference| by parameter): {diff}"


# ---------------------------------------------------------------------------------------------- the tests

def test_whole_rounds_are_diloco() -> None:
    """R = 4 replicas, 4 rounds of H = 3 inner steps (Nesterov SGD with a cosine schedule, carried over rounds), the
    default outer step: `cmemi reference` is the oracle's DiLoCo, bitwise."""
    H, R, rounds = 3, 4, 4
    got = reference(*settings(H, R, rounds * H))
    assert_bitwise(got, diloco(H, R, rounds), initial())


INT8_CHUNK, MIN_NUMEL = 100, 256  # every weight compressed (the 32 × 10 one too), in chunks with remainders


def int8(x: torch.Tensor) -> torch.Tensor:
    """The int8 downlink written again: per chunk of INT8_CHUNK values the absmax a, q = round(x · 127 / a), sent as
    q · (a / 127); a tensor under MIN_NUMEL goes as it is."""
    if x.numel() < MIN_NUMEL:
        return x.clone()
    flat, out = x.reshape(-1), torch.empty(x.numel())
    for lo in range(0, flat.numel(), INT8_CHUNK):
        ch = flat[lo: lo + INT8_CHUNK]
        a = ch.abs().max()
        out[lo: lo + ch.numel()] = (ch * (127.0 / a)).round() * (a / 127.0) if a > 0 else 0.0
    return out.view(x.shape)


def test_whole_rounds_with_a_downlink_start_from_the_mirror() -> None:
    """compression.downlink int8 with whole rounds: `cmemi reference` is the oracle's DiLoCo whose replicas start from
    the mirror m_t (moved by the decoded int8 change of θ after each outer step), bitwise; its result (θ) differs from
    the one without the downlink. Catches a round started from θ_t instead of m_t, or a mirror not moved."""
    H, R, rounds = 3, 4, 4
    down = ("compression.downlink=int8", f"compression.int8_chunk={INT8_CHUNK}",
            f"compression.min_compress_numel={MIN_NUMEL}")
    got = reference(*settings(H, R, rounds * H, *down))
    want = diloco(H, R, rounds, down=int8)
    assert_bitwise(got, want, initial())
    plain = diloco(H, R, rounds)
    assert any(not torch.equal(want[n], plain[n]) for n in want)


@pytest.mark.parametrize("mix", [0.25, 0.0])
def test_streaming_is_streaming_diloco(mix: float) -> None:
    """F = 3 fragments of an H = 6 round (segments of 2 inner steps), R = 3 replicas, 12 segments: `cmemi reference` is
    the oracle's Streaming DiLoCo, bitwise. α = 0.25, not 0.5, which would hide swapped weights; α = 0, the paper's
    plain replacement, which `fragments.merge` computes as a copy. With F = 3 the merged fragment (s − 2) mod F is
    neither the synced one nor the next."""
    H, F, R, segments = 6, 3, 3, 12
    L = H // F
    got = reference(*settings(H, R, segments * L, f"train.fragments={F}", f"train.fragment_mix={mix}"))
    assert_bitwise(got, streaming(H, F, R, mix, segments), initial())
