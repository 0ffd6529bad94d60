"""Data loader processes (services/worker/compute/loader.py): the same bits as reading in the worker, for datasets that
augment with torch, numpy and `random` and batches of any nesting; user errors come back as the same one-line
failure; a SIGKILLed loader is replaced and what it held is read in the worker; loaders die with their worker."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from cmemi.services.worker.compute.loader import Loader
from cmemi.services.worker.compute.microbatch import MicrobatchRunner, UserCodeError
from cmemi.shared.config.loading import load_config
from cmemi.shared.config.usercode import RemoteFailure, describe
from cmemi.shared.core.data import microbatch_indices, read_microbatch
from torch.utils.data import Dataset

from tests.conftest import DIGITS, ROOT
from tests.helpers.chaos import poll

Pair = collections.namedtuple("Pair", "x y")
CFG = load_config(DIGITS, ["run.name=loader", "train.global_batch=16", "train.microbatches=4"])


class Augmenting(Dataset):
    """Each item draws from torch, numpy and `random`; the batch is nested (a dict and a list, bools, ints)."""

    def __init__(self, n: int = 64, grow: bool = False, fail_at: int | None = None) -> None:
        self.n, self.grow, self.fail_at = n, grow, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise ValueError(f"item {i} is corrupt")
        width = 8 + (torch.initial_seed() % 8 if self.grow else 0) * 4096  # some microbatches need bigger slots
        x = torch.randn(width) + float(np.random.normal()) + random.random()
        return {"x": x[:8], "big": x, "mask": x > 0}, [i, float(i) / 2]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def test_batches_are_bitwise_those_read_in_the_worker_whatever_was_guessed() -> None:
    ds = Augmenting(grow=True)
    loader = Loader(CFG, ds, workers=2, slots=2)
    try:
        for step in range(6):
            loader.want(step, range(4))
            for m in range(4):
                got = loader.get(step, m)
                assert got is not None
                batch, release = got
                assert same(batch, read_microbatch(CFG, ds, len(ds), step, m)), (step, m)
                release()
            loader.guess(step + 1, [3, 2] if step % 2 else range(4))  # a wrong guess is dropped, never served
        loader.want(20, [1])
        loader.want(21, [0, 1])  # what was wanted and not taken is dropped too
        batch, release = loader.get(21, 1)
        assert same(batch, read_microbatch(CFG, ds, len(ds), 21, 1))
    finally:
        loader.close()


def test_user_code_that_raises_in_a_loader_is_the_same_one_line_failure() -> None:
    ds = Augmenting(fail_at=int(microbatch_indices(CFG.run.seed, 64, 16, 4, 0, 2)[0]))
    loader = Loader(CFG, ds, workers=1)
    try:
        with pytest.raises(RemoteFailure) as remote:
            loader.get(0, 2)
        with pytest.raises(ValueError) as local:
            read_microbatch(CFG, ds, len(ds), 0, 2)
        assert describe(remote.value) == describe(local.value)
        assert "item" in describe(remote.value).line() and "test_loader.py" in describe(remote.value).location
        assert loader.get(0, 1) is not None  # the loader goes on
    finally:
        loader.close()


def test_runner_reports_loader_failures_as_user_code_and_reads_unsupported_batches_itself() -> None:
    class Odd(Augmenting):
        def __getitem__(self, i: int):
            return Pair(torch.ones(3), i)  # a namedtuple would arrive as a tuple: read in the worker instead

    from cmemi.shared.config.plugins import build_model

    runner = MicrobatchRunner(CFG, build_model(CFG), Odd(), lambda out, y: out.sum())
    runner.loader = Loader(CFG, runner.dataset, workers=1)
    try:
        batch, release = runner._read(0, 0)
        assert type(batch) is Pair and batch.x.shape == (4, 3) and runner.loader.unsupported == "a Pair"
    finally:
        runner.loader.close()
    corrupt = int(microbatch_indices(CFG.run.seed, 64, 16, 4, 0, 1)[0])
    bad = MicrobatchRunner(CFG, build_model(CFG), Augmenting(fail_at=corrupt), lambda out, y: out.sum())
    bad.loader = Loader(CFG, bad.dataset, workers=1)
    try:
        with pytest.raises(UserCodeError) as err:
            bad._read(0, 1)
        assert "reading microbatch" in err.value.phase and "corrupt" in describe(err.value.cause).line()
    finally:
        bad.loader.close()


class Slow(Augmenting):
    """0.1 s per sample (a decoding dataset): a loader is still reading the next microbatch when it is killed."""

    def __getitem__(self, i: int):
        import time

        time.sleep(0.1)
        return super().__getitem__(i)


def test_a_killed_loader_is_replaced_and_what_it_held_is_read_in_the_worker() -> None:
    ds = Slow()
    loader = Loader(CFG, ds, workers=1, slots=2)  # microbatches 2 and 3 wait for a slot when it dies
    try:
        loader.want(0, range(4))
        first = loader.get(0, 0)
        assert first is not None
        victim = loader.procs[0].pid
        os.kill(victim, signal.SIGKILL)  # it has just begun reading microbatch 1 (0.4 s)
        rest = [loader.get(0, m) for m in (1, 2, 3)]
        assert rest[0] is None, "microbatch 1 was not lost with the loader?"
        assert loader.deaths == 1 and loader.procs[0].pid != victim
        first[1]()  # a batch of the dead loader released late frees no slot of the new one (both hold 2 and 3)
        assert not loader.procs[0].free, loader.procs[0].free
        for r in rest[1:]:
            r[1]()
        assert sorted(loader.procs[0].free) == [0, 1], loader.procs[0].free
        for r, m in zip(rest, (1, 2, 3), strict=True):
            if r is not None:
                assert same(r[0], read_microbatch(CFG, ds, len(ds), 0, m))
        loader.want(1, range(4))
        for m in range(4):
            batch, release = loader.get(1, m)
            assert same(batch, read_microbatch(CFG, ds, len(ds), 1, m))
            release()
    finally:
        loader.close()


def test_loaders_show_their_role_and_die_with_their_worker() -> None:
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tests.test_loader import CFG, Augmenting
        from cmemi.services.worker.compute.loader import Loader
        loader = Loader(CFG, Augmenting(), workers=2)
        print(" ".join(str(p.pid) for p in loader.procs), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        want = [b"cmemi", b"loader", b"--worker-pid", str(proc.pid).encode()]
        for pid in pids:  # (a loader renames itself right after the fork)
            cmdline = Path(f"/proc/{pid}/cmdline")
            poll(lambda cmdline=cmdline: cmdline.read_bytes().rstrip(b"\0").split(b"\0")[2:6] == want, 10, f"loader {pid}'s title")
        proc.kill()
        proc.wait(timeout=10)
        poll(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), 10, "the loaders' exit")
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_a_batch_whose_header_is_too_big_is_read_in_the_worker() -> None:
    class Texts(Augmenting):
        def __getitem__(self, i: int):
            return torch.ones(2), "x" * 10_000  # 40 kB of strings in a microbatch of 4: it travels

    class Novels(Augmenting):
        def __getitem__(self, i: int):
            return torch.ones(2), "x" * 30_000  # 120 kB: over the loader's 64 KiB header

    for ds, travels in ((Texts(), True), (Novels(), False)):
        loader = Loader(CFG, ds, workers=1)
        try:
            got = loader.get(0, 0)
            assert (got is not None) == travels
            if got is not None:
                assert same(got[0], read_microbatch(CFG, ds, len(ds), 0, 0))
            assert loader.get(0, 1) is not None or not travels  # the loader goes on either way
        finally:
            loader.close()
