"""The zygote's check of the config's functions, in a forked child, and the generators' states its model leaves.

check_plugins (shared/config/plugins.py) builds a model and steps an optimizer: torch ops the zygote must not run
(a thread pool in it would hang the children it forks), so a child runs it while the zygote goes on building the
data (cmemi/launcher/zygote_data.py). The child builds the model as a worker does — torch's generator seeded with
run.seed, then model.factory, with one intra-op thread — so the global generators' states right after it are the
ones a worker's dataset factory starts from: the child sends them on a second pipe the moment the model exists,
and the zygote never builds a model of its own (kept there, it would be one more copy of the weights for the whole
run, in the memory of every process it forks).
"""

from __future__ import annotations

import os
import sys
import traceback

from cmemi.launcher import zygote_user_code as user_code
from cmemi.shared.runtime import prebuilt

GPU = b"gpu"  # instead of the states: model.factory opened the GPU (its generators are more than these three)


class Check:
    """check_plugins on `config` in a forked child: `model_generators()` then `verdict()`, in the zygote."""

    def __init__(self, config: str) -> None:
        self.r_verdict, w_verdict = os.pipe()
        self.r_model, w_model = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover (a child: coverage never sees it)
            os.close(self.r_verdict)
            os.close(self.r_model)
            _run(config, w_verdict, w_model)
        os.close(w_verdict)
        os.close(w_model)
        self.generators: prebuilt.Generators | str | None = None

    def model_generators(self) -> prebuilt.Generators | str | None:
        """The generators' states right after the child's build_model; a reason not to share the data when they
        cannot be known; None when it built no model (the check fails, and says why in its verdict). Waits for the
        model, not for the rest of the check."""
        if self.r_model >= 0:
            with os.fdopen(self.r_model, "rb") as f:
                data = f.read()
            self.r_model = -1
            self.generators = (None if not data else "model.factory opened the GPU, whose generator a worker's "
                               "dataset factory might draw from next" if data == GPU else prebuilt.decode(data))
        return self.generators

    def verdict(self) -> tuple[int, str | None]:
        """The check's exit code and one-line error (None when it passed or printed a traceback)."""
        self.model_generators()  # the pipe is closed in the zygote before it forks anything
        chunks = []
        while chunk := os.read(self.r_verdict, 65536):
            chunks.append(chunk)
        os.close(self.r_verdict)
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace") or None


def _run(config: str, w_verdict: int, w_model: int) -> None:
    """In the child: check, send the generators once the model exists and the verdict at the end; never returns."""
    code, message = 0, ""
    try:
        import torch

        from cmemi.shared.config.checks import ConfigError
        from cmemi.shared.config.extras import MissingExtra
        from cmemi.shared.config.loading import load_config
        from cmemi.shared.config.plugins import check_plugins

        user_code.after_fork()
        torch.set_num_threads(1)  # a worker's build (the data is shared only with cluster.threads_per_worker: 1)
        start = prebuilt.states()

        def built(_model: torch.nn.Module) -> None:
            with os.fdopen(w_model, "wb") as f:
                f.write(GPU if torch.cuda.is_initialized() else prebuilt.encode(prebuilt.moved(start)))

        try:
            check_plugins(load_config(config), built)
        except (ConfigError, MissingExtra) as exc:
            code, message = 2, str(exc)
    except BaseException:  # the user's code raised something else: its traceback says where
        traceback.print_exc()
        code, message = 1, ""
    os.write(w_verdict, message.encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
