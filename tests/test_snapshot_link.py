"""The aggregator's side of the checkpointer link (services/aggregator/snapshots/send.py), driven for real against a
checkpointer played by a ROUTER socket (tests/helpers/rig.py): tests/test_checkpointer_retry.py plays the aggregator
with a raw socket, so only this test fails if the link stops sending a snapshot again after `retry` (e.g. with
`self._retry_at = None` where the retry is noted)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import zmq
from cmemi.services.aggregator.snapshots.send import CheckpointerLink

from tests.helpers.rig import PlayedCheckpointer, context, until

pytestmark = pytest.mark.timeout(60)


def snapshot(step: int) -> tuple[int, dict, dict[str, torch.Tensor]]:
    return step, {"progress": {"step": step}}, {"model.w": torch.arange(8, dtype=torch.float32)}


@pytest.fixture
def link_and_checkpointer(tmp_path: Path, redis_server):
    ctx = context(tmp_path, redis_server.url)
    played = PlayedCheckpointer(ctx, answers=["retry", "retry"])
    zctx = zmq.Context()
    drops: list[tuple[str, str]] = []
    link = CheckpointerLink(ctx, zctx, term=7, on_drop=lambda reason, detail: drops.append((reason, detail)))
    try:
        yield link, played
    finally:
        link.close()
        if link.sock is not None:
            link.sock.close(linger=0)
        zctx.term()
        played.close()


def test_a_snapshot_answered_retry_is_sent_again_until_it_is_written(link_and_checkpointer) -> None:
    link, played = link_and_checkpointer
    link.offer(snapshot(5))

    def wait() -> None:
        link.poll()
        if link.sock is not None:
            link.sock.poll(10)
        else:  # not connected yet: the link's watch reads the checkpointer's address from Redis on its thread
            threading.Event().wait(0.01)

    until(lambda: link.idle, 20, "the snapshot written after two retries", wait)
    assert played.snapshots == [5, 5, 5], played.snapshots  # sent, asked again twice, written the third time


def test_the_final_snapshot_answered_retry_is_sent_again_and_its_path_returned(link_and_checkpointer) -> None:
    link, played = link_and_checkpointer
    assert link.save_final(snapshot(9), timeout=20) == "ckpt-9"
    assert played.snapshots == [9, 9, 9], played.snapshots
