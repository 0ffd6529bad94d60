"""The zygote's import of the user's modules: paid once per host instead of once per process.

The zygote (cmemi/launcher/zygote.py) imports the modules the config's import paths name (`mypkg.models:make_net` ->
`mypkg.models`) before it forks any service: import only, in the context a plain script would have (no factory
is called, nothing is patched). A module that fails to import is left to the config check, which names it.

Forking is safe only while no thread pool exists. A module that runs a large torch op at import starts torch's
OpenMP pool, and a forked child's next parallel region then hangs; with one intra-op thread it runs without
the pool. So: when the imports started threads, children are given one intra-op thread before anything else
runs (`after_fork`), which is what `cluster.threads_per_worker: 1` asks anyway; with more than one, the zygote
serves nobody for this run (one line says why) and every service starts as a fresh process.
"""

from __future__ import annotations

import importlib
import os
import sys

_threads_started = False  # the user's imports started threads in the zygote


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def preload(config: str) -> bool:
    """Import the user's modules named by `config` (unless cluster.zygote_imports is false). False when the
    zygote must not fork for this run."""
    global _threads_started
    from cmemi.launcher.launch import user_code_importable
    from cmemi.shared.config.checks import ConfigError
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.plugins import user_modules

    try:
        cfg = load_config(config)
    except ConfigError:
        return True  # the config check says why, in one line
    if not cfg.cluster.zygote_imports:
        return True
    user_code_importable()
    before = threads()
    for name in user_modules(cfg):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: B036 -- any import failure is the config check's to report (it imports again)
            pass
    _threads_started = threads() > before
    if _threads_started and cfg.cluster.threads_per_worker > 1:
        print(f"cmemi: importing {', '.join(user_modules(cfg))} started threads (a torch op at import starts its "
              f"thread pool), and a forked child with cluster.threads_per_worker={cfg.cluster.threads_per_worker} "
              "would hang: the services start as fresh processes (set cluster.zygote_imports: false to keep the "
              "zygote without importing them)", file=sys.stderr, flush=True)
        return False
    return True


def note_threads() -> None:
    """Something after the imports (cmemi/launcher/zygote_data.py: a factory) started threads in the zygote."""
    global _threads_started
    _threads_started = True


def after_fork() -> None:
    """In a child the zygote forked: one intra-op thread when the user's imports started the pool."""
    if _threads_started:
        import torch

        torch.set_num_threads(1)
