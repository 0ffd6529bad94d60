"""A fault for tests/test_shards.py, loaded into every Python process of a run by PYTHONPATH=tests/inject:
with CMEMI_TEST_SKIP_SHARD="step:k", a worker's gradient of that step never reaches shard k (as when a worker
dies between its sends), and the worker forgets every shard's slice it holds (as a replacement would), so the
microbatches leased again are computed from slices pulled anew."""

import os

_spec = os.environ.get("CMEMI_TEST_SKIP_SHARD")
if _spec:
    from cmemi.services.worker import shards as _shards

    _step, _shard = (int(x) for x in _spec.split(":"))
    _push = _shards.ShardLinks.push

    def push(self, encoded, fields):  # type: ignore[no-untyped-def]
        if fields["step"] != _step or getattr(self, "skipped", False):
            return _push(self, encoded, fields)
        self.skipped = True
        for link, (info, frames) in zip(self.links, encoded, strict=True):
            if link.k != _shard:
                self._send(link, "grad", tensors=frames, codec=info, **fields)
        for link in self.links:
            link.have, link.got, link.asked = -1, None, -1
        return None

    _shards.ShardLinks.push = push
