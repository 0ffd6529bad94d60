"""The aggregator (parameter server). Run: `cmemi aggregator --config RUN_DIR/config.yaml` (Redis URL in $CMEMI_REDIS_URL)."""

from __future__ import annotations

import sys

from cmemi.services.aggregator.leader.server import Aggregator
from cmemi.services.aggregator.shard.server import ShardServer
from cmemi.shared.runtime.exits import Exit, exit_now
from cmemi.shared.runtime.service import common_parser, start_service


def main(argv: list[str] | None = None) -> None:
    parser = common_parser("aggregator", __doc__)
    parser.add_argument("--shard", type=int, default=0, help="which parameter-server shard (0..cluster.shards-1; "
                        "0, the leader, also leases the work)")
    args = parser.parse_args(argv)
    ctx = start_service("aggregator", args, **({"shard": args.shard} if args.shard else {}))
    if not 0 <= args.shard < ctx.cfg.cluster.shards:
        ctx.fatal(f"--shard {args.shard}: this run has cluster.shards: {ctx.cfg.cluster.shards} (shards 0.."
                  f"{ctx.cfg.cluster.shards - 1})")
    if (state := ctx.run_state()) in ("completed", "failed"):
        # restarted after the run's end (e.g. it died in its last moments, after the final checkpoint): there is
        # nothing to serve, and waiting for a checkpointer (which exits once the run is over) would never end
        ctx.log.info("the run has ended; nothing to serve", state=state)
        return
    if args.shard:
        shard = ShardServer(ctx, args.shard)
        try:
            code = shard.run()
        finally:
            shard.close()
        if code == Exit.REJOIN:  # leaving its term to restart at once: closed (its ZeroMQ context too), no teardown
            exit_now(code)
        sys.exit(code)
    agg = Aggregator(ctx)
    try:
        agg.run()
    finally:
        agg.close()


if __name__ == "__main__":
    main()
