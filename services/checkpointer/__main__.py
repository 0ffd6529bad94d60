"""The checkpointer. Run: `cmemi checkpointer --config RUN_DIR/config.yaml` (Redis URL in $CMEMI_REDIS_URL) on the host that owns the disk."""

from __future__ import annotations

from cmemi.services.checkpointer.server import Checkpointer
from cmemi.shared.runtime.service import common_parser, start_service


def main(argv: list[str] | None = None) -> None:
    args = common_parser("checkpointer", __doc__).parse_args(argv)
    ctx = start_service("checkpointer", args)
    ckpt = Checkpointer(ctx)
    try:
        ckpt.run()
    finally:
        ckpt.close()


if __name__ == "__main__":
    main()
