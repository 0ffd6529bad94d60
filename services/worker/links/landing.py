"""Where a shard k > 0's slice lands in the worker's model, and how it gets there (shard_links.py asks and waits).

- `target`: chosen from a message's header before its first byte is read: the model's own pieces for a slice of the
  version being fetched (`fetching`), else a buffer of its own (a late or early answer must not overwrite the
  parameters of the version the model holds, which a lease may still need).
- `copy`: every stage of the slice received into the model's pieces (what landed there already stays). Over ipc:// a
  shard may grant shared-memory slots (shared/memory/shm.py): a slice then comes as slot descriptors, copied from the
  slot and used only if the slot did not change meanwhile (else the fetch fails and the worker asks again). With
  compression.downlink the slice is the change from the version the pieces hold, applied by the function the shard
  used on its mirror; streaming (train.fragments), only the pieces changed since.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from cmemi.services.worker.links.shard_link import Link
from cmemi.shared.compression import downlink
from cmemi.shared.compression.base import CodecError
from cmemi.shared.config.schema import Config
from cmemi.shared.core.fragments import PIECES, land
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.runtime.service import ServiceContext
from cmemi.shared.wire import limits, protocol
from cmemi.shared.wire.layout import LayoutError


class SliceLanding:
    def __init__(self, ctx: ServiceContext, cfg: Config) -> None:
        self.ctx = ctx  # (its log and fatal, read when needed)
        self.fetching: int | None = None  # the version `fetch` is bringing into the model: only its slices land there
        self.reader = shm_reader.Reader(ctx.run, shm.checksums(cfg.cluster.checksum),
                                        limit=4 * max(1, cfg.cluster.shards), bound=limits.logical_bytes(cfg))
        # compression.downlink: a slice is the change of the mirror from the version a pull says it holds (`have`)
        self.downlink = downlink.codec(cfg.compression) if cfg.compression.downlink != "none" else None
        self.downlink_dropped = 0

    @contextlib.contextmanager
    def fetch(self, version: int) -> Iterator[None]:
        """While `version` is fetched, its slices land in the model's pieces."""
        self.fetching = version
        try:
            yield
        finally:
            self.fetching = None

    def target(self, link: Link, header: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """Where a message from shard k lands, chosen from its header: the model's own pieces for a slice of the
        version being fetched (the answer to that pull), else a buffer of its own (None).

        From its first byte on, the model's pieces of shard k are neither the old version nor the new one until
        the last: `have` is -1 until `fetch` sees the whole slice, so nothing is computed on half a slice (an
        abandoned transfer leaves it -1: the next fetch pulls it again, or the shard is lost and the worker says
        hello again)."""
        if (header["type"] == "slice" and self.fetching is not None and link.have != self.fetching
                and header["downlink"] not in (downlink.DELTA, PIECES)  # a change lands aside, then goes in
                and header["version"] == header["asked"] == self.fetching
                and 0 <= header["stage"] < len(link.views)
                and all(v.device.type == "cpu" for v in link.views[header["stage"]].values())):
            stage = header["stage"]
            link.have = -1
            views, before = link.views[stage], link.got[stage]
            if before is not None and any(before.tensors.get(n) is v for n, v in views.items()):
                link.got[stage] = None  # it landed here too: what these bytes hold is no longer that message
            return views
        return None

    def _change(self, link: Link, msg: protocol.Message) -> bool:
        """compression.downlink: shard k's change from the version our pieces hold into them, by the function the
        shard used on its mirror; False (nothing changed) if it is from another version or malformed (counted)."""
        h = msg.header
        if self.downlink is None or link.have < 0 or h["base"] != link.have or len(link.views) != 1:
            return False
        try:
            downlink.apply(self.downlink, link.views[0], h["codec"], msg.tensors,
                           {n: tuple(v.shape) for n, v in link.views[0].items()})
        except CodecError as exc:
            self.downlink_dropped += 1
            self.ctx.log.warning("parameter change dropped; asking for the whole slice", shard=link.k,
                                 reason=exc.reason, detail=str(exc)[:200], dropped=self.downlink_dropped)
            return False
        return True

    def copy(self, link: Link) -> bool:
        """Every stage of the slice received into the model's pieces of shard k (what landed there already stays);
        False if a stage's slot is unusable or changed while copied (the pieces then hold no version)."""
        if link.got[0] is not None and link.got[0].header["downlink"] == downlink.DELTA:
            return self._change(link, link.got[0])
        if link.got[0] is not None and link.got[0].header["downlink"] == PIECES:  # streaming: the changed pieces
            got = link.got[0]
            return link.have >= 0 and got.header["base"] == link.have and len(link.views) == 1 and \
                land(got.tensors, link.views[0], ())
        descs = []
        try:
            received: dict[str, torch.Tensor] = {}
            for layout, msg in zip(link.layouts, link.got, strict=True):
                assert msg is not None
                tensors = msg.tensors
                if "shm" in msg.header and link.slots and not tensors:
                    descs.append(msg.header["shm"])
                    tensors = self.reader.views(descs[-1])
                received.update(layout.views(tensors) if layout.flat else tensors)
            targets = {n: v for stage in link.views for n, v in stage.items()}
            if received.keys() != targets.keys():
                raise LayoutError(f"pieces {sorted(received)[:3]}..., expected {sorted(targets)[:3]}...")
            with torch.no_grad():
                for name, view in targets.items():
                    if received[name] is not view:  # landed elsewhere (not in place): copy
                        view.copy_(received[name])
        except protocol.ProtocolError as exc:  # a bad descriptor, or a slot rewritten before it was read
            self.ctx.log.warning("slice slot unusable; asking again", shard=link.k, reason=exc.reason)
            return False
        except (LayoutError, RuntimeError) as exc:
            self.ctx.fatal(f"worker: shard {link.k}'s parameters do not fit this worker's model ({exc}); use the "
                           "same model.factory, model.kwargs, cluster.shards and cluster.pipeline_stages on every host")
        del received
        return all(self.reader.intact(d) for d in descs)
