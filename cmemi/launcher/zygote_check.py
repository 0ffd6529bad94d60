"""The zygote's check of the config's functions, in a forked child, while the zygote builds the data.

check_plugins (shared/config/plugins.py) builds a model and steps an optimizer with the default thread count:
torch ops the zygote must not run (a thread pool in it would hang the children it forks), so a child runs it,
on the other core while the zygote builds the data (cmemi/launcher/zygote_data.py), and the zygote reads its
verdict before it listens.
"""

from __future__ import annotations

import os
import sys
import traceback

from cmemi.launcher import zygote_user_code as user_code


class Check:
    """check_plugins on `config` in a forked child; `verdict()` waits for it."""

    def __init__(self, config: str) -> None:
        self.r_verdict, w_verdict = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover (a child: coverage never sees it)
            os.close(self.r_verdict)
            _run(config, w_verdict)
        os.close(w_verdict)

    def verdict(self) -> tuple[int, str | None]:
        """The check's exit code and one-line error (None when it passed or printed a traceback)."""
        chunks = []
        while chunk := os.read(self.r_verdict, 65536):
            chunks.append(chunk)
        os.close(self.r_verdict)
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace") or None


def _run(config: str, w_verdict: int) -> None:
    """In the child: check, and send the verdict; never returns."""
    code, message = 0, ""
    try:
        from cmemi.shared.config.checks import ConfigError
        from cmemi.shared.config.extras import MissingExtra
        from cmemi.shared.config.loading import load_config
        from cmemi.shared.config.plugins import check_plugins

        user_code.after_fork()
        try:
            check_plugins(load_config(config))
        except (ConfigError, MissingExtra) as exc:
            code, message = 2, str(exc)
    except BaseException:  # the user's code raised something else: its traceback says where
        traceback.print_exc()
        code, message = 1, ""
    os.write(w_verdict, message.encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
