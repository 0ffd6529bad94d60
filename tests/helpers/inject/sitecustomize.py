"""A fault for tests/test_shards.py, loaded into every Python process of a run by PYTHONPATH=tests/helpers/inject:
with CMEMI_TEST_SKIP_SHARD="step:k[:g]", a worker's gradient of that step never reaches shard k (from stage g on,
when steps are pipelined: the stages before it arrive and are stepped), as when a worker dies between its sends,
and the worker forgets every shard's slice it holds (as a replacement would), so the microbatches leased again
are computed from slices pulled anew."""

import os

_spec = os.environ.get("CMEMI_TEST_SKIP_SHARD")
if _spec:
    from cmemi.services.worker.links import shard_links as _shards

    _step, _shard, *_rest = (int(x) for x in _spec.split(":"))
    _from_stage = _rest[0] if _rest else 0
    _push = _shards.ShardLinks.push

    def push(self, encoded, fields, trackers=None):  # type: ignore[no-untyped-def]
        if fields["step"] != _step or getattr(self, "skipped", False):
            return _push(self, encoded, fields, trackers)
        self.skipped = True
        for link, stages in zip(self.links, encoded, strict=True):
            for g, (info, frames) in enumerate(stages):
                if link.k != _shard or g < _from_stage:
                    self._send(link, "grad", tensors=frames, trackers=trackers, codec=info, stage=g, **fields)
        for link in self.links:
            link.have, link.asked = -1, -1
            link.reset()
        return None

    _shards.ShardLinks.push = push
