"""What `cmemi up` does to make a local run secure by default.

- CurveZMQ keys for the run, one pair per role, in RUN_DIR/keys (secrets 0600, directory 0700), unless
  the config names its own `security.keys_dir` or turns Curve off on purpose (`security.curve: false`).
  A resumed run keeps its keys.
- The effective config (RUN_DIR/config.yaml, which then names the key directory and may hold a Redis
  URL with its password) is readable by its owner only.
- The Redis URL reaches the coordinator, and through it every service, in the environment
  (CMEMI_REDIS_URL), never on a command line.
"""

from __future__ import annotations

import os
from pathlib import Path

from cmemi.shared.config.loading import dump_config
from cmemi.shared.config.schema import Config
from cmemi.shared.runtime.service import REDIS_URL_ENV
from cmemi.shared.wire.security import generate


def secure_run(cfg: Config, run_dir: Path) -> None:
    if cfg.security.curve and not cfg.security.keys_dir:
        generate(run_dir / "keys", if_missing=True)
        cfg.security.keys_dir = str(run_dir / "keys")
    config = run_dir / "config.yaml"
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(dump_config(cfg))
    tmp.chmod(0o600)
    os.replace(tmp, config)


def child_env(redis_url: str) -> dict[str, str]:
    return {**os.environ, REDIS_URL_ENV: redis_url}
