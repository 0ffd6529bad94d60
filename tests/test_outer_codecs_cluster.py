"""Real clusters with the outer-change codecs (issue 48): `cmemi up` gives `cmemi reference`'s params_sha256 with
int4, int2 and sparse2 changes at W = 1, 2, 3 and K = 1, 2, whole rounds and streaming, and after a worker SIGKILL
(sparse2: the dead worker's replicas are recomputed elsewhere from their states, residual included). Whole rounds
also with θ coming down through a downlink codec (`compression.downlink`: a round starts from the mirror m_t), whose
mirror_sha256 is the reference's too. That the reference is the algorithm itself is tests/test_outer_codecs_oracle.py's
(and, for the mirror, tests/test_diloco_oracle.py's)."""

from __future__ import annotations

import pytest

from tests.helpers.chaos import Cluster
from tests.test_local_steps import LOCAL, STREAM, reference, run_up

# every tensor of the digits MLP but its biases compressed, in chunks with remainders
CODEC = ("compression.min_compress_numel=256", "compression.lowbit_chunk=100", "compression.sparse_chunk=300",
         "compression.topk_ratio=0.02")


def check(tmp_path, sets: tuple[str, ...], runs: tuple[tuple[int, int], ...], steps: int) -> dict:
    want = reference(tmp_path, *sets)
    assert want["steps"] == steps
    got = {}
    for k, w in runs:
        r = run_up(tmp_path / f"k{k}w{w}", *sets, f"cluster.shards={k}", f"cluster.workers={w}")
        assert r.rc == 0, r.stderr[-3000:]
        assert r.summary["steps"] == steps
        assert set(r.summary["dropped_messages"]) <= {"duplicate", "stale_step"}, r.summary
        got[(k, w)] = r.summary["params_sha256"]
        assert r.summary.get("mirror_sha256") == want.get("mirror_sha256"), (k, w, r.summary, want)
    assert set(got.values()) == {want["params_sha256"]}, (got, want["params_sha256"])
    return want


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("codec, downlink", [("sparse2", "none"), ("int4", "none"), ("int2", "none"),
                                             ("int4", "int8"), ("none", "sign"), ("sparse2", "int8"),
                                             ("int4", "int4")])
def test_whole_rounds_with_an_outer_codec_give_the_reference(tmp_path, codec: str, downlink: str) -> None:
    """12 rounds of 5 inner steps of 4 replicas: W = 1, 2, 3 at K = 1 and W = 2, 3 at K = 2 (int4 both ways, the
    home-links system's codecs: W = 2 at K = 1 and W = 3 at K = 2 only, for CI's time); the codecs change the result
    (it differs from the fp32 reference, and a downlink's from the same uplink's without it)."""
    up = (*LOCAL, f"compression.codec={codec}", *CODEC)
    sets = (*up, f"compression.downlink={downlink}")
    runs = ((1, 2), (2, 3)) if downlink == "int4" else ((1, 1), (1, 2), (1, 3), (2, 2), (2, 3))
    want = check(tmp_path, sets, runs, 12)
    assert want["params_sha256"] != reference(tmp_path, *LOCAL)["params_sha256"]
    if downlink != "none":
        assert "mirror_sha256" in want and want["params_sha256"] != reference(tmp_path, *up)["params_sha256"]


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("codec", ["sparse2", "int4"])
def test_streaming_with_an_outer_codec_gives_the_reference(tmp_path, codec: str) -> None:
    """Streaming, 3 fragments of a 6-step round, 4 replicas: W = 1, 3 at K = 1 and W = 2 at K = 2."""
    check(tmp_path, (*STREAM, f"compression.codec={codec}", *CODEC), ((1, 1), (1, 3), (2, 2)), 36)


@pytest.mark.integration
@pytest.mark.fault
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fragments, downlink", [(1, "none"), (3, "none"), (1, "int8")])
def test_sparse2_survives_a_worker_killed(tmp_path, fragments: int, downlink: str) -> None:
    """sparse2, K = 2 (whole rounds) or K = 1 (streaming), W = 2 and a spare, a paced model: SIGKILL a worker mid-run;
    its replicas are computed again elsewhere from the states the leader keeps (streaming: replayed from snapshots),
    each with its residual: bitwise the reference's. With an int8 downlink (whole rounds) the replacement is sent the
    mirror whole and its rounds start from m_t as the others': the reference's params_sha256 and mirror_sha256."""
    base = STREAM if fragments > 1 else (*LOCAL, "train.steps=200", "scheduler.kwargs.T_max=200")  # 40 rounds
    sets = (*[s for s in base if not s.startswith(("checkpoint", "cluster.spare", "eval"))], "checkpoint.every_steps=4",
            "cluster.dead_after=1.0", "cluster.heartbeat_interval=0.1", "compression.codec=sparse2", *CODEC,
            f"compression.downlink={downlink}")
    want = reference(tmp_path, *sets)
    c = Cluster(tmp_path / "run", *sets, f"cluster.shards={1 if fragments > 1 else 2}", "cluster.workers=2",
                "cluster.spare_workers=1", "model.factory=tests.helpers.fixtures:paced_mlp", "model.kwargs={pace: 0.01}")
    try:
        c.wait_step(3, timeout=300)
        inc = c.signal("worker", "w0")
        c.replaced("worker", "w0", inc, timeout=120)
    finally:
        rc = c.wait(timeout=600)
    assert rc == 0, c.output()
    assert c.summary["steps"] == want["steps"]
    assert c.summary["params_sha256"] == want["params_sha256"], (c.summary["params_sha256"], want["params_sha256"])
    assert c.summary["inner_states_sent"] > 0, c.summary  # replicas moved with their states (and residuals)
    assert c.summary.get("mirror_sha256") == want.get("mirror_sha256"), (c.summary, want)
    if downlink != "none":  # θ came down as changes; whole to each worker's first pull from each of the K = 2 servers,
        # the replacement's too (2 × 3)
        assert c.summary["changes_sent"] > 0 and c.summary["mirrors_sent"] >= 6, c.summary
