"""Run in a fresh interpreter (`python -m tests.helpers.zygote_data_probe MODE CONFIG`): the zygote's data build
against a process's own, or a forked child's parallel region after the build. Prints one JSON object.

equal: a child forked after cmemi/launcher/zygote_data.py's build takes the model and dataset as a worker does
(plugins.build_model, then build_dataset); a second child builds both itself. Each reports digests of the model's
weights, the dataset's tensors, the items of three microbatches read as the workers read them, and the global
generators' states right after the builds; the parent reports whether its own generators were put back.

fork: after the build, a forked child runs a parallel region on 2 intra-op threads; it must finish (a zygote that
had started OpenMP's pool would leave it hanging). The parent waits for it with a deadline.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import signal
import sys
from typing import Any

import numpy
import torch


def digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(p.detach().contiguous().numpy().tobytes())
        elif isinstance(p, numpy.ndarray):
            h.update(p.tobytes())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()


def report(config: str) -> dict[str, Any]:
    from cmemi.shared.config.loading import load_config
    from cmemi.shared.config.plugins import build_dataset, build_model
    from cmemi.shared.core.data import read_microbatch
    from cmemi.shared.runtime import prebuilt

    cfg = load_config(config)
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    held = prebuilt.held()
    model = build_model(cfg)
    dataset = build_dataset(cfg)
    t, n, r = prebuilt.states()
    out = {"held": held, "model": digest(*model.state_dict().values()), "data": digest(dataset.x, dataset.y),
           "torch_rng": digest(t), "numpy_rng": digest(n[1], n[2:]), "random_rng": digest(r)}
    out["again"] = digest(*build_model(cfg).state_dict().values())  # a second call builds afresh, the same
    out["items"] = digest(*[read_microbatch(cfg, dataset, len(dataset), s, m)[0] for s in (0, 5) for m in (0, 3)])
    return out


def in_child(fn: Any, deadline_s: float) -> dict[str, Any]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    pidfd = os.pidfd_open(pid)
    ended = select.select([pidfd], [], [], deadline_s)[0]  # readable once the child has exited
    os.close(pidfd)
    if not ended:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"hung": True}
    os.waitpid(pid, 0)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    return json.loads(data) if data else {"crashed": True}


def parallel_region() -> dict[str, Any]:
    torch.set_num_threads(2)
    return {"sum": float(torch.ones(1 << 22).mul(2.0).sum())}


def main(mode: str, config: str) -> None:
    from cmemi.shared.runtime import prebuilt

    from cmemi.launcher import zygote_data, zygote_user_code

    before = [digest(*prebuilt.states()[0:1]), digest(numpy.random.get_state()[1]), digest(random.getstate())]
    tasks = zygote_user_code.threads()
    verdict = zygote_data.build(config)
    out: dict[str, Any] = {"shared": verdict.shared, "error": verdict.error, "grew": zygote_user_code.threads() - tasks,
                           "put_back": before == [digest(*prebuilt.states()[0:1]),
                                                  digest(numpy.random.get_state()[1]), digest(random.getstate())]}
    if mode == "equal":
        out["zygote"] = in_child(lambda: report(config), 120)
        prebuilt.drop()
        out["fresh"] = in_child(lambda: report(config), 120)
    else:
        out["child"] = in_child(parallel_region, 60)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
