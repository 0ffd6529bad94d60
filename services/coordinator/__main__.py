"""The coordinator. Run: `cmemi coordinator --config RUN_DIR/config.yaml --redis URL [--supervise local|none]`."""

from __future__ import annotations

import sys

from cmemi.services.coordinator.coordinator import Coordinator
from cmemi.shared.service import common_parser, start_service


def main(argv: list[str] | None = None) -> None:
    p = common_parser("coordinator", __doc__)
    p.add_argument("--supervise", choices=["local", "none"], default="none",
                   help="local: start and restart every service as a child process; "
                        "none: an orchestrator restarts them, the coordinator detects, fences and re-admits")
    args = p.parse_args(argv)
    ctx = start_service("coordinator", args)
    coord = Coordinator(ctx, args.supervise, args.config, args.redis or ctx.cfg.cluster.redis or "")
    try:
        rc = coord.run()
    finally:
        coord.close()
    sys.exit(rc)


if __name__ == "__main__":
    main()
