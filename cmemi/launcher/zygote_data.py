"""Data built once per host: the zygote calls the dataset factory before it forks the services.

A user module that builds its dataset in its factory made every worker build the same data at the same time on
the same cores (issue 46's MNIST-1D case; `python bench/startup_data.py` measures it). As PyTorch's DataLoader
forks its workers after the dataset exists, the zygote (cmemi/launcher/zygote.py) builds it once, after importing
the user's modules and before it listens, and every worker it forks shares it copy-on-write
(shared/runtime/prebuilt.py says how a worker takes it; the other services free it at once).

Same bits as each worker building its own: the calls are a worker's, in a worker's order and conditions — torch's
generator seeded with run.seed, model.factory, then data.factory, with one intra-op thread (the workers'
cluster.threads_per_worker) — so the dataset factory finds what a worker's finds: the generators where the model
left them, and whatever module state (a cache, a vocabulary) the model factory set. The generators' states after
the dataset's call go with it; the zygote's own are put back, so a process that takes nothing starts as fresh. The
model itself is dropped at once: kept, it would be one more copy of the weights for the whole run (the workers
replace theirs with the parameters they receive), in the memory of every process the zygote forks.

Fork safety (cmemi/launcher/zygote_user_code.py): with one intra-op thread torch runs no parallel region, so no
OpenMP pool exists to hang a child. Not shared, with one line saying why: with cluster.threads_per_worker > 1
(the workers build with that many threads, and a pool in the zygote would hang its children), when a factory
started a thread (a forked child would hold the object without it), and when one opened the GPU (no forked
child could use it: the zygote then serves nobody, every service starts fresh). A data.factory that raises is
the user's one-line error (shared/core/data.py data_error), exit 2, before any service starts; a model.factory
that raises is left to the config check (cmemi/launcher/zygote_check.py), which says it the same way.
"""

from __future__ import annotations

import gc
import random
import sys
from dataclasses import dataclass

import numpy
import torch

from cmemi.launcher import zygote_user_code as user_code
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.plugins import data_key
from cmemi.shared.config.schema import Config
from cmemi.shared.core.data import data_error
from cmemi.shared.runtime import prebuilt


@dataclass(frozen=True)
class Verdict:
    shared: bool = False  # the dataset is kept for the workers
    error: str | None = None  # data.factory raised: the run's one-line error (exit 2)
    unsafe: bool = False  # the zygote must fork nothing more (a factory opened the GPU)


def say(why: str) -> None:
    print(f"cmemi: data is built in every process, not once per host: {why}", file=sys.stderr, flush=True)


def build(config: str) -> Verdict:
    """Build the dataset the config's workers would build, once, and keep it for them (see the module)."""
    try:
        cfg = load_config(config)
    except ConfigError:
        return Verdict()  # the config check says why, in one line
    if not (cfg.cluster.zygote_imports and cfg.cluster.zygote_data):
        return Verdict()
    if cfg.cluster.threads_per_worker > 1:
        n = cfg.cluster.threads_per_worker
        say(f"cluster.threads_per_worker={n}: a worker builds it with {n} intra-op threads, and a thread pool in the "
            "zygote would hang the processes it forks (set cluster.threads_per_worker: 1 to build it once)")
        return Verdict()
    tasks = user_code.threads()
    verdict = _build(cfg)
    gc.collect()  # the model, gone before anything is forked
    if torch.cuda.is_initialized():
        prebuilt.drop()
        say("model.factory or data.factory opened the GPU in the zygote, where no forked process could use it; every "
            "service starts fresh (set cluster.zygote_data: false to keep the zygote from calling them)")
        return Verdict(unsafe=True)
    if user_code.threads() > tasks:
        prebuilt.drop()
        user_code.note_threads()
        say("model.factory or data.factory started a thread, which a forked worker would not have (set "
            "cluster.zygote_data: false to keep the zygote from calling them)")
        return Verdict(error=verdict.error)
    return verdict


def _build(cfg: Config) -> Verdict:
    """A worker's calls (services/worker/worker.py: build_model, then the dataset), the model dropped at once, with
    the zygote's generators and thread count put back afterwards."""
    threads, before = torch.get_num_threads(), prebuilt.states()
    torch.set_num_threads(1)
    try:
        torch.random.default_generator.manual_seed(cfg.run.seed)  # torch.manual_seed's CPU part: no GPU queued
        try:
            model = resolve(cfg.model.factory, "model.factory")(**cfg.model.kwargs)
        except Exception:  # the config check builds it again and says it in one line (plugins.FactoryError)
            return Verdict()
        if not isinstance(model, torch.nn.Module):
            return Verdict()  # likewise
        del model  # built for what it leaves behind (the generators, the module's caches), not kept: see the module
        start = prebuilt.states()
        try:
            dataset = resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs)
        except ConfigError as exc:
            return Verdict(error=str(exc))
        except Exception as exc:  # the user's data: one line naming the call, what it raised and where
            return Verdict(error=data_error("cmemi up (building the data once per host)", cfg, exc))
        after_data = prebuilt.moved(start)
    finally:
        torch.set_rng_state(before[0])
        numpy.random.set_state(before[1])
        random.setstate(before[2])
        torch.set_num_threads(threads)
    prebuilt.keep("dataset", data_key(cfg), dataset, after_data)
    return Verdict(shared=True)
