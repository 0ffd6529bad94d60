"""Faults for tests/test_shards.py, loaded into every Python process of a run by PYTHONPATH=tests/helpers/inject.

With CMEMI_TEST_SKIP_SHARD="step:k[:g]", a worker's gradient of that step never reaches shard k (from stage g on,
when steps are pipelined: the stages before it arrive and are stepped), as when a worker dies between its sends,
and the worker forgets every shard's slice it holds (as a replacement would), so the microbatches leased again
are computed from slices pulled anew.

With CMEMI_TEST_KILL_LEADER_AT_FINISH=<a file that does not exist yet>, the first leader to end the run SIGKILLs
itself as its end begins (leader/finish.py), its last commit out of ZeroMQ first (its context terminated, at most
2 s): every shard has applied the last step, and the final checkpoint is not written. Its successor does not."""

import os
import signal
import threading

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

_kill_mark = os.environ.get("CMEMI_TEST_KILL_LEADER_AT_FINISH")
if _kill_mark:
    from cmemi.services.aggregator.leader import finish as _ending

    _finish = _ending.finish

    def finish(parts, stepper, pump):  # type: ignore[no-untyped-def]
        try:
            os.close(os.open(_kill_mark, os.O_CREAT | os.O_EXCL))
        except FileExistsError:  # a later leader: the run ends
            return _finish(parts, stepper, pump)
        parts.sock.close(linger=2000)  # what is queued for the shards (the last commit) goes before the context ends
        ending = threading.Thread(target=parts.zctx.term, daemon=True)
        ending.start()
        ending.join(timeout=2.0)
        os.kill(os.getpid(), signal.SIGKILL)
        return None

    _ending.finish = finish
