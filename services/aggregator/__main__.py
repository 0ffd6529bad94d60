"""The aggregator (parameter server). Run: `cmemi aggregator --config RUN_DIR/config.yaml` (Redis URL in $CMEMI_REDIS_URL)."""

from __future__ import annotations

from cmemi.services.aggregator.server import Aggregator
from cmemi.shared.service import common_parser, start_service


def main(argv: list[str] | None = None) -> None:
    args = common_parser("aggregator", __doc__).parse_args(argv)
    ctx = start_service("aggregator", args)
    agg = Aggregator(ctx)
    try:
        agg.run()
    finally:
        agg.close()


if __name__ == "__main__":
    main()
