"""One torchft replica group = one process (CPU, gloo, 1 intra-op thread) training a bench workload.

    python bench/torchft_train.py --replica-id 0 --num-replicas 2 --lighthouse http://host:port --log r0.jsonl

The same model, data and optimizer as bench/torch_train.py (the plain/DDP baseline): the workload's model
and synthetic data (bench.models.WORKLOADS), SGD with momentum 0.9, and a global batch of `global_batch`
samples per step split evenly over the replica groups by CMEMI's sharding function (replica r trains
slice r of step s's batch, s = manager.current_step()).

torchft pieces, as in torchft's train_ddp.py: a TCPStore of its own (a group of size 1), ProcessGroupGloo,
Manager(min_replica_size=1, replica_id="bench_<id>") talking to the lighthouse, and the Optimizer wrapper
(quorum at zero_grad, should_commit at step). A replica that (re)starts behind the others heals from a peer
through the manager's default checkpoint transport (HTTP).

Gradients (`--grad-sync`): `manual` (default) allreduces all gradients as one flat buffer with
`manager.allreduce(...).wait()` after backward -- one bucket, as DDP does for a model this small (1.3 MB).
`ddp` uses torchft.DistributedDataParallel instead; in torchft 0.2.0 (and its main branch) its comm hook
does `assert fut._fut` after `work.wait()`, which fails when the allreduce raised (a peer died: gloo
"Connection closed by peer"), so the *surviving* replica crashes with an AssertionError -- which is why
the recovery benchmark uses `manual`.

`--log` gets one JSON line per committed step, flushed at once:
    {"step": manager.current_step(), "t": time.time(), "replica": id, "participants": manager.num_participants(),
     "loss": ...}
and a few lines with an "event" key instead of "step": "start" (t_proc = before importing torch),
"ready" (manager and model built) and "not_committed" (a step the manager discarded, e.g. after a peer died
in the allreduce).
"""

from __future__ import annotations

import time

T_PROC = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class JsonlLog:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1)

    def write(self, rec: dict[str, Any]) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def allreduce_grads(manager: Any, params: list[Any]) -> None:
    """Average the gradients over the participating replica groups, as one flat buffer. An error (a peer died)
    is swallowed and reported to the manager, whose should_commit() then discards the step."""
    import torch

    grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()  # AVG over manager.num_participants(); zeroed while healing
    offset = 0
    for q, g in zip(params, grads, strict=True):
        k = g.numel()
        q.grad = flat[offset:offset + k].view_as(g)
        offset += k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--num-replicas", type=int, default=2, help="replica groups the global batch is split over")
    p.add_argument("--lighthouse", required=True, help="lighthouse address, e.g. http://host:port")
    p.add_argument("--log", required=True, help="JSONL file: one line per committed step")
    p.add_argument("--workload", default="small", help="a key of bench.models.WORKLOADS")
    p.add_argument("--steps", type=int, default=10_000_000, help="stop after this global step")
    p.add_argument("--pg-timeout", type=float, default=5.0, help="ProcessGroupGloo timeout (s), as in train_ddp.py")
    p.add_argument("--timeout", type=float, default=30.0, help="Manager timeout (s), as in train_ddp.py")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="Manager quorum timeout (s)")
    p.add_argument("--grad-sync", choices=("manual", "ddp"), default="manual",
                   help="flat-buffer manager.allreduce (default) or torchft.DistributedDataParallel")
    args = p.parse_args()

    log = JsonlLog(args.log)
    rid = args.replica_id
    log.write({"event": "start", "replica": rid, "pid": os.getpid(), "t_proc": T_PROC, "t": time.time()})

    import torch
    import torch.nn.functional as F
    from cmemi.shared.config.lookup import resolve
    from cmemi.shared.core.data import fetch, microbatch_indices
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from bench.models import WORKLOADS

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    w = WORKLOADS[args.workload]

    torch.manual_seed(0)
    model = resolve(w["model"]["factory"], "model")(**w["model"]["kwargs"])
    dataset = resolve(w["data"]["factory"], "data")(**w["data"]["kwargs"])
    inner_opt = torch.optim.SGD(model.parameters(), lr=w.get("lr", 0.01), momentum=0.9)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])

    # the replica group's own store (its rank 0 is this process); port 0: a free port
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{rid}",
        lighthouse_addr=args.lighthouse,
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=args.timeout),
    )
    net = DistributedDataParallel(manager, model) if args.grad_sync == "ddp" else model
    params = [q for q in model.parameters() if q.requires_grad]
    opt = Optimizer(manager, inner_opt)
    B, n = w["global_batch"], len(dataset)
    log.write({"event": "ready", "replica": rid, "t": time.time()})

    try:
        while manager.current_step() < args.steps:
            s = manager.current_step()
            x, y = fetch(dataset, microbatch_indices(0, n, B, args.num_replicas, s, rid))
            opt.zero_grad(set_to_none=True)  # starts the quorum (async), heals if behind
            loss = F.cross_entropy(net(x), y)
            loss.backward()  # ddp: gradient allreduce over the participating replica groups, in backward
            if args.grad_sync == "manual":
                allreduce_grads(manager, params)
            opt.step()  # should_commit: steps the optimizer only if every participant succeeded
            now = time.time()
            if manager.current_step() > s:
                log.write({"step": manager.current_step(), "t": now, "replica": rid,
                           "participants": manager.num_participants(), "loss": round(float(loss.detach()), 5)})
            else:
                log.write({"event": "not_committed", "at_step": s, "t": now, "replica": rid,
                           "error": str(manager.errored())[:200] if manager.errored() else None})
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
