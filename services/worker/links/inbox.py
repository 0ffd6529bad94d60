"""Where a worker's received parameters land: the leader's slice and the step's buffers.

A small model's arrive as flat buffers (shared/wire/layout.py); on a CPU its parameters and step buffers are views
into them, so one frame per dtype lands in place and nothing is copied. A bigger model's arrive one frame per
piece, each straight into its rows of the model on a CPU. Elsewhere (a GPU's pinned inbox, or a small model whose
leader's slice is not whole tensors) what lands is copied into the model. What lands in place is half written
until a transfer's last part: the worker forgets its version meanwhile (links/leader.py), so it never computes on it.
The step's buffers are always a copy: each microbatch starts from them, while the forward pass changes the
model's own.

A same-host leader's shared-memory slot is read in place (`lend`): the model's parameters become read-only views
of the slot, nothing is copied, and the worker checks afterwards that the slot was not rewritten while it computed
(services/worker/lease.py). `own` points them back at the worker's own storage before anything writes there.
"""

from __future__ import annotations

import torch
from cmemi.shared.core.buffers import PREFIX
from cmemi.shared.core.grid import Partition
from cmemi.shared.wire import protocol
from cmemi.shared.wire.layout import Layout, LayoutError


class Inbox:
    def __init__(self, partition: Partition, params: dict[str, torch.Tensor],
                 step_buffers: dict[str, torch.Tensor], device: torch.device) -> None:
        self.partition, self.params, self.step_buffers = partition, params, step_buffers
        pieces = partition.views(params, 0)
        wire = {**pieces, **{PREFIX + n: b for n, b in step_buffers.items()}}
        self.layout = Layout(wire)
        cpu = device.type == "cpu"
        # a slot can be the model's parameters only on a CPU, where the leader sends every row of every tensor
        self.lends = cpu and partition.shards == 1
        self.lent = False
        if self.layout.flat:
            whole = partition.shards == 1 and not partition.split  # the leader sends whole tensors, all of them
            self.bound = cpu and whole  # the model's tensors are views into the inbox: what lands there is in place
            self.tensors = self.layout.empty(pin_memory=not cpu)
            if self.bound:
                with torch.no_grad():
                    for name, view in self.layout.views(self.tensors).items():
                        view.copy_(wire[name])
                        if name.startswith(PREFIX):
                            step_buffers[name[len(PREFIX):]] = view
                        else:
                            params[name].data = view
        else:
            # One frame per piece: on a CPU each lands straight in its rows of the model (a piece is a contiguous run
            # of rows, shared/core/grid.py), at any cluster.shards; no second copy of the leader's slice is kept.
            self.bound = cpu
            landing = pieces if cpu else {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                                          for n, p in pieces.items()}
            self.tensors = {**landing, **{PREFIX + n: b for n, b in step_buffers.items()}}
        self.owned = {n: p.data for n, p in params.items()}  # the parameters' own storage (see `own`)

    def take(self, msg: protocol.Message) -> bool:
        """The parameters and step buffers of a `work` message into the model; False if they are not in our layout."""
        self.own()
        received = self._received(msg)
        if received is None:
            return False
        # On a CPU the inbox is the model's own tensors (or the flat buffers they are views into): what landed
        # there is in place already. Otherwise (a GPU's pinned inbox, or a tensor that did not fit) copy.
        if not (self.bound and all(msg.tensors[k] is self.tensors.get(k) for k in msg.tensors)):
            with torch.no_grad():
                for name, p in self.partition.views(self.params, 0).items():
                    p.copy_(received[name])
                for name, b in self.step_buffers.items():
                    b.copy_(received[PREFIX + name])
        return True

    def lend(self, msg: protocol.Message) -> bool:
        """The parameters of a slot's `work` (read-only views of it) as the model's, in place; the step's buffers
        copied. False, and nothing changed, if they are not in our layout or a tensor's pieces are not adjacent in
        the slot (then `take` copies them). Only where `lends`."""
        assert self.lends
        received = self._received(msg)
        whole = self._whole(received) if received is not None else None
        if received is None or whole is None:
            return False
        for name, p in self.params.items():
            p.data = whole[name]
        with torch.no_grad():
            for name, b in self.step_buffers.items():
                b.copy_(received[PREFIX + name])
        self.lent = True
        return True

    def lendable(self, msg: protocol.Message) -> bool:
        """Would `lend` take this message (our layout, each tensor's pieces back to back)? Nothing changes."""
        received = self._received(msg)
        return received is not None and self._whole(received) is not None

    def _whole(self, received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Each parameter as one view of the slot its pieces (shared/core/grid.py, rows in order) lie in, back to back;
        None where that does not hold, or a piece is missing or does not fit."""
        runs: dict[str, list[torch.Tensor]] = {}
        for piece in self.partition.pieces:
            v, p = received.get(piece.name), self.params[piece.param]
            rows = p.shape if p.dim() == 0 else (piece.hi - piece.lo, *p.shape[1:])
            if v is None or v.dtype != p.dtype or tuple(v.shape) != tuple(rows):
                return None
            runs.setdefault(piece.param, []).append(v)
        out = {}
        for name, p in self.params.items():
            run = runs.get(name)
            if not run:
                return None
            first = run[0]
            if len(run) > 1:
                ends = [v.data_ptr() + v.numel() * v.element_size() for v in run[:-1]]
                if any(v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or v.data_ptr() != end
                       for v, end in zip(run[1:], ends, strict=True)):
                    return None
                # (torch's stubs name set_ with a stride or with the storage alone; the stride defaults, contiguous)
                first = torch.empty(0, dtype=p.dtype).set_(  # type: ignore[call-overload]
                    first.untyped_storage(), first.storage_offset(), p.shape)
            out[name] = first
        return out

    def own(self) -> None:
        """The parameters back in the worker's own storage (what they held before `lend`: stale until written)."""
        if self.lent:
            for name, p in self.params.items():
                p.data = self.owned[name]
            self.lent = False

    def _received(self, msg: protocol.Message) -> dict[str, torch.Tensor] | None:
        if not self.layout.flat:
            return msg.tensors
        if msg.header["layout"] != self.layout.digest or msg.tensors.keys() != self.tensors.keys():
            return None
        try:
            return self.layout.views(msg.tensors)
        except LayoutError:
            return None
