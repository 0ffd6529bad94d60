"""The baselines: the same model, data and optimizer as the CMEMI runs, as a plain single-process PyTorch
loop, or as DDP (gloo) under torchrun:

    python bench/torch_train.py --workload compute_bound --steps 30 --out plain.json
    python -m torch.distributed.run --nproc_per_node 2 bench/torch_train.py --workload ... --out ddp.json

Each step consumes a global batch of `global_batch` samples (split evenly over the DDP ranks), chosen by
CMEMI's own sharding function, so the data work per step is the same as in CMEMI.

For recovery measurements (`--ckpt-dir`, `--ckpt-every`, `--events`): rank 0 writes a checkpoint every
K steps (torch.save to a temporary file, then an atomic rename), every (re)start resumes from the
newest one, and rank 0 appends `start` / `resumed` / `step` records (wall-clock `t`) to a JSONL file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cmemi.shared.config.lookup import resolve  # noqa: E402
from cmemi.shared.core.data import fetch, microbatch_indices  # noqa: E402

from bench.models import WORKLOADS  # noqa: E402


def append(path: str | None, rec: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="compute_bound", help="a key of bench.models.WORKLOADS, or a JSON object")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON result file (rank 0)")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--events", default=None, help="JSONL file for start/resumed/step records (rank 0; pids: all ranks)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (slows a tiny model down)")
    p.add_argument("--powersgd-rank", type=int, default=0,
                   help="DDP only: register torch's PowerSGD communication hook at this rank (0: dense all-reduce)")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    w = WORKLOADS[args.workload] if args.workload in WORKLOADS else json.loads(args.workload)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    distributed = world > 1
    t_proc = time.time()
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    append(args.events, {"kind": "start", "rank": rank, "pid": os.getpid(), "restart": restart, "t": time.time(),
                         "t_proc": t_proc})

    torch.manual_seed(0)
    model = resolve(w["model"]["factory"], "model")(**w["model"]["kwargs"])
    dataset = resolve(w["data"]["factory"], "data")(**w["data"]["kwargs"])
    opt = torch.optim.SGD(model.parameters(), lr=w.get("lr", 0.01), momentum=0.9)
    start = 0
    if args.ckpt_dir:
        ck = Path(args.ckpt_dir) / "latest.pt"
        if ck.exists():
            state = torch.load(ck, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = int(state["step"])
        if rank == 0:
            append(args.events, {"kind": "resumed", "from_step": start, "restart": restart, "t": time.time()})
    net = model
    if distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # PowerSGD on gloo needs one bucket: with DDP's default small first bucket (from the second step on), the
        # hook's chained all-reduces of two buckets reach gloo in different orders on different ranks and abort
        # ("Received data size doesn't match expected size"); an explicit bucket_cap_mb drops the small first bucket
        net = DDP(model, bucket_cap_mb=25) if args.powersgd_rank else DDP(model)
        if args.powersgd_rank:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            # dense for the first 2 steps (the hook's minimum with error feedback and warm start), then rank-r factors
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=2)
            net.register_comm_hook(state, psgd.powerSGD_hook)
    B = w["global_batch"]
    n = len(dataset)
    times, cpus = [], []
    t_prev, c_prev = time.perf_counter(), time.process_time()
    for step in range(start, args.steps):
        idx = microbatch_indices(0, n, B, world, step, rank)
        x, y = fetch(dataset, idx)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        now, cnow = time.perf_counter(), time.process_time()
        times.append(now - t_prev)
        cpus.append(cnow - c_prev)
        t_prev, c_prev = now, cnow
        done = step + 1
        if rank == 0:
            append(args.events, {"kind": "step", "step": done, "restart": restart, "t": time.time(),
                                 "loss": float(loss.detach())})
        if args.ckpt_dir and args.ckpt_every and done % args.ckpt_every == 0 and rank == 0:
            tmp = Path(args.ckpt_dir) / f".tmp-{os.getpid()}.pt"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, tmp)
            os.replace(tmp, Path(args.ckpt_dir) / "latest.pt")
    cpu_meas = torch.tensor([sum(cpus[args.warmup:] or cpus)], dtype=torch.float64)
    if distributed:
        dist.all_reduce(cpu_meas)  # CPU seconds of all ranks over the measured steps
    if rank == 0 and args.out:
        meas = times[args.warmup:] or times
        meas_sorted = sorted(meas)
        res = {"world": world, "steps": len(times), "step_times_s": times,
               "step_time_median_s": meas_sorted[len(meas_sorted) // 2] if len(meas) % 2 else
               (meas_sorted[len(meas) // 2 - 1] + meas_sorted[len(meas) // 2]) / 2,
               "wall_per_step_s": sum(meas) / len(meas), "cpu_s_per_step": float(cpu_meas) / len(meas),
               "final_loss": float(loss.detach())}
        Path(args.out).write_text(json.dumps(res))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
