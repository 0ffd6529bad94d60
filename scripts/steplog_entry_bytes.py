"""The step log entry's size for a config (docs/design/step-log.md, "Local steps"): the reduced change or gradient
slice, the buffer sum, and with train.local_steps the replicas' states the step makes current, for the first
server steps (streaming: each step carries a different fragment and the snapshots of different replicas). With the
checkpointer's spool on (the default) those states are written to the server's own state spool and the entry carries
a reference to them (services/aggregator/steplog/statespool.py): both sizes are shown; `--set
checkpoint.step_log_spool=false` shows the entry that carries them.

    .venv/bin/python scripts/steplog_entry_bytes.py examples/digits.yaml --set train.local_steps=5 \
        --set train.replicas=4 --set train.steps=200

A state's bytes are those of a real one for this model and inner optimizer (`innerstate.layout_of`: one inner step
of zeros on a stand-in), as the leader receives and ships it.
"""

from __future__ import annotations

import argparse
import math

import torch
from cmemi.services.aggregator.common.trainer import Trainer
from cmemi.shared.config.loading import load_config
from cmemi.shared.core import fragments, innerstate


def state_bytes(trainer: Trainer) -> int:
    """One replica's state (its inner optimizer and scheduler; streaming, its parameters; sparse2, its residual)."""
    layout = innerstate.layout_of(trainer.cfg, {n: (p.shape, p.dtype) for n, p in trainer.params.items()})
    return sum(math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()
               for _name, dtype, shape in layout[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[], help="a config override, as for cmemi up")
    ap.add_argument("--steps", type=int, default=4, help="server steps to show (streaming: one line each)")
    args = ap.parse_args()
    trainer = Trainer(load_config(args.config, args.set))
    cfg, inner = trainer.cfg, trainer.inner
    params = {n: p.numel() * p.element_size() for n, p in trainer.pieces.items()}
    buffers = sum(b.numel() * b.element_size() for b in trainer.buffers.values())
    one = state_bytes(trainer) if inner is not None else 0
    spool = inner is not None and cfg.checkpoint.step_log_spool  # (steplog/statespool.py)
    print(f"model P = {sum(params.values()):,} B; buffers {buffers:,} B; one replica's state S = {one:,} B")
    for step in range(args.steps):
        change = sum(params[n] for n in (trainer.expected(step) or params))
        shipping = [] if inner is None else [r for r in range(inner.R) if (
            fragments.ships_state(step, trainer.snapshot_every, r) if trainer.fragments
            else innerstate.due(step, r, cfg.train.state_every))]
        states = one * len(shipping)
        of = f"{len(shipping)} of {cfg.train.microbatches if inner is not None else 0} replicas' states"
        if spool:  # the states go to the server's own state spool; the entry carries their references
            print(f"entry of server step {step + 1}: {change + buffers:,} B = change {change:,} + buffers "
                  f"{buffers:,} (+ {of}' metadata and references); the server's state spool: {states:,} B")
        else:
            print(f"entry of server step {step + 1}: {change + buffers + states:,} B = change {change:,} + buffers "
                  f"{buffers:,} + {of} {states:,}")


if __name__ == "__main__":
    main()
