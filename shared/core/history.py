"""The versions a replica's replay starts its rounds from (`train.state_every` = D > 1, issue 48; docs/design/
local-steps.md, "Snapshotted every D rounds").

With D > 1 a replica's state reaches its server only after the rounds `innerstate.due` names, so whoever takes
replica r at round t without its live state gets the snapshot that starts round s = `innerstate.snapshot_start(t, r,
D)` and computes rounds s … t − 1 again before round t, each from the parameters that round started from: θ_u (with
`compression.downlink`, the mirror m_u a worker held). The servers step θ in place, so each keeps its own pieces of
those versions here, from the oldest current snapshot's round to the current one: at most D versions, D · P/K bytes
per server (counted in `limits.logical_bytes`, as a checkpoint of the leader holds them: `state_dict`).

A version outside that window is refused with the reason, never answered with other bits: a replay from the wrong θ
would give a wrong result silently. With D = 1 nothing is kept (a snapshot always starts the current round).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from cmemi.shared.core.innerstate import snapshot_start


class Versions:
    def __init__(self, replicas: int, every: int) -> None:
        """`replicas`: R, whose snapshots decide the oldest version still needed; `every`: D (`train.state_every`)."""
        self.R, self.every = replicas, every
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def on(self) -> bool:
        return self.every > 1

    def oldest(self, version: int) -> int:
        """The oldest version a replay at `version` may start from: the earliest round a current snapshot starts."""
        return min((snapshot_start(version, r, self.every) for r in range(self.R)), default=version)

    def keep(self, version: int, pieces: Mapping[str, torch.Tensor]) -> None:
        """The pieces a round at `version` starts from, copied (the next step changes the live ones in place); the
        versions no current snapshot needs any more go."""
        if not self.on:
            return
        self.kept[version] = {n: t.detach().clone() for n, t in pieces.items()}
        lo = self.oldest(version)
        for v in [v for v in self.kept if v < lo or v > version]:  # (a restore to an earlier version drops the later)
            del self.kept[v]

    def get(self, version: int) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """(the pieces at `version`, None), or (None, why this server cannot answer it)."""
        if version in self.kept:
            return self.kept[version], None
        held = f"{min(self.kept)}..{max(self.kept)}" if self.kept else "none"
        return None, (f"version {version} is not in this server's history (versions held: {held}; train.state_every "
                      f"= {self.every} keeps those since the oldest current snapshot)")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for v in self.kept.values() for t in v.values())

    def state_dict(self) -> dict[int, Any]:
        """For a server's snapshot: the window's versions, so that a restore can answer a replay as the server it
        replaces would (docs/design/local-steps.md, "Recovery")."""
        return dict(self.kept)

    def load_state_dict(self, sd: Mapping[Any, Any] | None) -> None:
        self.kept = {int(v): dict(p) for v, p in (sd or {}).items()}
