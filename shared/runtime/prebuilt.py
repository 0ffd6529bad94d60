"""What `cmemi up`'s zygote built before it forked (the workers' training dataset), for the one process call that
would build it again.

Data built once per host (cluster.zygote_data, cmemi/launcher/zygote_data.py): the zygote calls the factories as a
worker does, keeps the dataset here with the global random generators' states right after its factory ran, and
forks the services; a worker shares it copy-on-write. The worker `take`s it once, in place of calling the factory,
and its generators are set to the states the factory would have left them in: torch's CPU generator always (seeded
with run.seed before the model, its state is the same in every process), numpy's and `random`'s only where the
factory moved them (a factory that seeds them itself left the state its seed gives in any process; one that does
not has drawn as a fresh process's entropy would). Any later call builds afresh, as it always did.

It is taken only under the key it was built for (plugins.py data_key: the factories, their kwargs, run.seed): a
process whose config differs builds its own. Nothing here imports the config: plugins.py asks, the zygote fills.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy
import torch


@dataclass(frozen=True)
class Generators:
    """The global generators' states after a factory ran (None: the factory left that generator alone)."""

    torch_cpu: torch.Tensor
    numpy_state: tuple[Any, ...] | None
    random_state: tuple[Any, ...] | None


@dataclass(frozen=True)
class Built:
    key: str  # what it was built from (shared/config/plugins.py data_key)
    value: Any
    after: Generators


_kept: dict[str, Built] = {}  # "dataset" -> what the zygote built; emptied by `take`


States = tuple[torch.Tensor, Any, tuple[Any, ...]]  # torch's CPU generator, numpy's (its legacy tuple), `random`'s


def states() -> States:
    """The three global generators' states now (torch's CPU generator, numpy's, `random`'s)."""
    return torch.get_rng_state(), numpy.random.get_state(), random.getstate()


def moved(before: States) -> Generators:
    """The generators' states now, numpy's and `random`'s only where they differ from `before`."""
    t, n, r = states()
    same_numpy = n[0] == before[1][0] and all(numpy.array_equal(a, b) for a, b in zip(n[1:], before[1][1:], strict=True))
    return Generators(t, None if same_numpy else n, None if r == before[2] else r)


def restore(after: Generators) -> None:
    torch.set_rng_state(after.torch_cpu)
    if after.numpy_state is not None:
        numpy.random.set_state(after.numpy_state)
    if after.random_state is not None:
        random.setstate(after.random_state)


def keep(name: str, key: str, value: Any, after: Generators) -> None:
    """In the zygote: `value` was built from `key`; the generators stood at `after` once it was."""
    _kept[name] = Built(key, value, after)


def take(name: str, key: str) -> tuple[bool, Any]:
    """(True, the object) once, with the generators set as building it would have left them; (False, None) when
    there is none for `key` (no zygote, not shared, another config, or taken already)."""
    built = _kept.pop(name, None)
    if built is None or built.key != key:
        return False, None
    restore(built.after)
    return True, built.value


def held() -> list[str]:
    """The names of what this process could still take."""
    return sorted(_kept)


def drop() -> None:
    """Forget everything: the zygote when it must not fork with it, a forked service that is no worker (freed at once
    rather than held, copy-on-write, for the whole run)."""
    _kept.clear()
