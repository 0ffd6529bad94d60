"""The coordinator. Run: `cmemi coordinator --config RUN_DIR/config.yaml [--supervise local|none]`."""

from __future__ import annotations

import os
import sys

from cmemi.services.coordinator.coordinator import Coordinator
from cmemi.services.coordinator.run_state import Supervise
from cmemi.shared.runtime.service import REDIS_URL_ENV, common_parser, redis_url, start_service


def main(argv: list[str] | None = None) -> None:
    p = common_parser("coordinator", __doc__)
    p.add_argument("--supervise", choices=[s.value for s in Supervise], default=Supervise.NONE.value,
                   help="local: start and restart every service as a child process; "
                        "none: an orchestrator restarts them, the coordinator detects, fences and re-admits")
    args = p.parse_args(argv)
    ctx = start_service("coordinator", args)
    os.environ[REDIS_URL_ENV] = redis_url(args, ctx.cfg) or ""  # what the children it starts inherit
    coord = Coordinator(ctx, Supervise(args.supervise), args.config)
    try:
        rc = coord.run()
    finally:
        coord.close()
    sys.exit(rc)


if __name__ == "__main__":
    main()
