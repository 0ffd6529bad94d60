"""A worker. Run: `cmemi worker --config RUN_DIR/config.yaml --worker-id w3` (Redis URL in $CMEMI_REDIS_URL) on any host with the data."""

from __future__ import annotations

import os
import socket

from cmemi.services.worker.worker import Worker
from cmemi.shared.runtime.service import common_parser, start_service


def main(argv: list[str] | None = None) -> None:
    p = common_parser("worker", __doc__)
    p.add_argument("--worker-id", default=None, help="stable id of this worker slot (default: hostname-pid)")
    p.add_argument("--spare", default=None, metavar="NAME",
                   help="start as a warm spare: load everything, then wait for the coordinator to assign an id")
    args = p.parse_args(argv)
    wid = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    ctx = start_service("worker", args, worker_id=args.spare or wid)
    worker = Worker(ctx, args.spare or wid)
    try:
        if args.spare:
            assigned = worker.life.wait_for_identity(args.spare)
            if assigned is None:
                return
            wid = assigned
        worker.assume(wid)
        worker.run()
    finally:
        worker.close()


if __name__ == "__main__":
    main()
