"""DDP's PowerSGD hook on the compression examples: what the speed goal's baseline costs in accuracy.

    .venv/bin/python bench/hook_accuracy.py [--examples charlm,digits] [--seeds 3] [--rank 2] [--out FILE]

bench/cluster.py compares CMEMI's compressed rows with DDP + torch's PowerSGD communication hook (rank 2) on speed;
bench/compression.py compares CMEMI's rows with dense both ways on accuracy. This is the missing corner: the same
example configs trained by DDP (gloo, `cluster.workers` ranks on this machine), dense and with the hook, at the same
steps, seeds, data order, initial weights, optimizer and schedule as the CMEMI runs (each rank takes its
`train.microbatches / workers` microbatches of every step as one batch, chosen by CMEMI's own sharding function), and
the hook's eval metric against dense DDP's at the same seed, as bench/compression.py reports `eval_vs_dense`. The hook
sends its first `--warmup` fraction of the steps dense (`start_powerSGD_iter`), as the CMEMI rows do
(`compression.warmup_steps`). Prints one JSON object (saved with `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench import common as C  # noqa: E402
from bench.compression import EXAMPLES  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, config: str, sets: list[str], hook_rank: int, warmup: int,
              out: str) -> None:
    """One DDP rank: the config's model, data, loss, optimizer and schedule; rank 0 writes the eval metrics."""
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.lookup import resolve
    from cmemi.shared.config.plugins import build_model, build_optimizer, build_scheduler
    from cmemi.shared.core.data import fetch, microbatch_indices
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(config, sets)
    model = build_model(cfg)  # seeded by run.seed: the CMEMI run's initial weights
    dataset = resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs)
    loss_fn = resolve(cfg.train.loss, "train.loss")
    opt = build_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    sched = build_scheduler(cfg, opt)
    net = DDP(model, bucket_cap_mb=25)  # one bucket: the hook on gloo needs it (bench/torch_train.py)
    if hook_rank:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=hook_rank,
                                   start_powerSGD_iter=max(2, warmup))
        net.register_comm_hook(state, psgd.powerSGD_hook)
    M, n = cfg.train.microbatches, len(dataset)
    mine = range(rank * M // world, (rank + 1) * M // world)
    model.train()
    for step in range(cfg.train.steps):
        idx = torch.cat([microbatch_indices(cfg.run.seed, n, cfg.train.global_batch, M, step, m) for m in mine])
        x, y = fetch(dataset, idx)
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        if cfg.train.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_grad_norm)
        opt.step()
        if sched is not None:
            sched.step()
    if rank == 0:
        Path(out).write_text(json.dumps(resolve(cfg.eval.fn, "eval.fn")(model)))
    dist.barrier()  # no rank leaves while another's gloo work is in flight (else gloo aborts the process at exit)
    dist.destroy_process_group()


def run(config: str, sets: list[str], hook_rank: int, warmup: int) -> dict:
    from cmemi.shared.config.loading import load_config

    world = load_config(config, sets).cluster.workers
    with tempfile.TemporaryDirectory(prefix="cmemi-hook-") as tmp:
        out = str(Path(tmp) / "eval.json")
        mp.spawn(rank_main, args=(world, free_port(), config, sets, hook_rank, warmup, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", default="charlm,digits", help="comma-separated: " + ",".join(EXAMPLES))
    ap.add_argument("--seeds", type=int, default=3, help="run.seed 0 .. K-1 (default 3)")
    ap.add_argument("--rank", type=int, default=2, help="the hook's matrix_approximation_rank (default 2)")
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of train.steps sent dense first (default 0.1)")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every run")
    ap.add_argument("--out", default=None, help="also write the JSON object here")
    args = ap.parse_args()
    from cmemi.shared.config.loading import load_config

    out: dict = {"bench": "hook_accuracy", **C.provenance(), "machine": C.machine(),
                 "command": " ".join([".venv/bin/python", "bench/hook_accuracy.py", *sys.argv[1:]]),
                 "hook_rank": args.rank, "examples": {}}
    for ex in args.examples.split(","):
        config, metric = str(ROOT / EXAMPLES[ex]["config"]), EXAMPLES[ex]["metric"]
        warmup = round(args.warmup * load_config(config, args.set).train.steps)
        dense, hook = [], []
        for seed in range(args.seeds):
            sets = [f"run.seed={seed}", *args.set]
            print(f"[hook_accuracy] {ex} seed {seed}", file=sys.stderr, flush=True)
            dense.append(run(config, sets, 0, warmup)[metric])
            hook.append(run(config, sets, args.rank, warmup)[metric])
        gaps = [h - d for h, d in zip(hook, dense, strict=True)]
        row = {"metric": metric, "warmup_steps": warmup, "ddp_dense_by_seed": dense, "ddp_hook_by_seed": hook,
               "hook_vs_dense": statistics.fmean(gaps), "hook_vs_dense_by_seed": gaps}
        if metric == "loss":
            row["hook_vs_dense_rel"] = statistics.fmean(g / d for g, d in zip(gaps, dense, strict=True))
        out["examples"][ex] = row
    C.emit_result(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
