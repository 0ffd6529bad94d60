"""A same-host worker computes on the leader's shared-memory slot in place (services/worker/links/lending.py): the model's
parameters are views of the slot, nothing is copied, and what it computed is dropped when the slot was rewritten
meanwhile. A model that writes its own parameters, or a slot whose tensors are not each in one run, is copied.

Units on real segments; then real clusters, bitwise against `cmemi reference` (or the same run over tcp://)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cmemi.services.worker.compute.block import BlockComputer, StaleParameters
from cmemi.services.worker.compute.microbatch import MicrobatchRunner
from cmemi.services.worker.links.inbox import Inbox
from cmemi.services.worker.links.lending import Lend, SlotLending
from cmemi.shared.config.loading import load_config
from cmemi.shared.core.grid import Partition
from cmemi.shared.memory import shm, shm_reader
from cmemi.shared.wire import protocol

from tests.conftest import DIGITS, FAST, run_up
from tests.test_shards import reference_sha

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, event: str, **_: object) -> None:
        self.lines.append(event)


def _model(rows: int) -> dict[str, torch.Tensor]:
    # over 16 MiB: one frame per piece (shared/wire/layout.py); "w" is cut into pieces of rows (shared/core/grid.py)
    return {"w": torch.nn.Parameter(torch.zeros(70000, rows)), "b": torch.nn.Parameter(torch.zeros(7))}


def _version(params: dict[str, torch.Tensor], partition: Partition, k: float) -> dict[str, torch.Tensor]:
    """Version k of the parameters, as the leader's slot holds them: its pieces in grid order."""
    full = {n: torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * k for n, p in params.items()}
    return partition.views(full, 0)


@pytest.mark.parametrize("rows, lends", [(64, True), (63, False)])
def test_a_slot_is_lent_in_place_only_when_each_tensor_lies_in_one_run(shm_run: str, rows: int, lends: bool) -> None:
    """Pieces of 64 floats a row lie back to back in the slot (each a multiple of its 64-byte alignment): the model's
    parameters become views of the slot, and `valid` holds until the slot is written again. Rows of 63 floats leave
    gaps: the version is copied, and the run copies from then on."""
    params = _model(rows)
    partition = Partition(params)
    assert partition.split  # "w" is in several pieces
    inbox, writer, reader, log = Inbox(partition, params, {}, torch.device("cpu")), shm.Writer(shm_run, "agg", False), \
        shm_reader.Reader(shm_run, False), _Log()
    own = params["w"].data_ptr()
    lending = SlotLending(inbox, reader, params, True, log)
    lending.mode = Lend.IN_PLACE  # (as after a first version that left the parameters unchanged: see the next test)
    desc = writer.write(_version(params, partition, 1.0))
    msg = protocol.Message({"shm": desc}, reader.views(desc))
    assert lending.load(msg)
    want = {n: torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) for n, p in params.items()}
    assert all(torch.equal(params[n], want[n]) for n in params)
    assert inbox.lent is lends and (params["w"].data_ptr() != own) is lends
    assert lending.valid()
    writer.write(_version(params, partition, 2.0))  # the other slot: the lent version is still whole
    assert lending.valid() and torch.equal(params["w"], want["w"])
    writer.write(_version(params, partition, 3.0))  # the lent slot rewritten: what was computed on it is void
    assert lending.valid() is not lends
    inbox.own()  # its own storage back (what `take` then writes: a lent version was never copied there)
    assert params["w"].data_ptr() == own and torch.equal(params["w"], want["w"] if not lends else torch.zeros(70000, 64))
    assert lending.mode is (Lend.IN_PLACE if lends else Lend.COPY)
    writer.close()


def test_the_first_version_is_copied_and_a_model_that_writes_its_parameters_is_never_lent(shm_run: str) -> None:
    for writes in (False, True):
        params = _model(64)
        partition = Partition(params)
        inbox, writer, reader, log = Inbox(partition, params, {}, torch.device("cpu")), shm.Writer(shm_run, "agg", False), \
            shm_reader.Reader(shm_run, False), _Log()
        lending = SlotLending(inbox, reader, params, True, log)
        desc = writer.write(_version(params, partition, 1.0))
        assert lending.load(protocol.Message({"shm": desc}, reader.views(desc))) and not inbox.lent  # copied
        if writes:
            with torch.no_grad():
                params["w"][0, 0] = -1.0  # what a forward pass clipping its weights in place does
        lending.computed()
        assert lending.mode is (Lend.COPY if writes else Lend.IN_PLACE)
        desc = writer.write(_version(params, partition, 2.0))
        assert lending.load(protocol.Message({"shm": desc}, reader.views(desc))) and inbox.lent is not writes
        assert log.lines == ([("the model's forward or backward pass writes its parameters: each version is copied "
                               "from the leader's slot, not read in place")] if writes else
                             ["parameters are read in place from the leader's slot",
                              "a version lent: the model computes in the leader's slot"])
        assert lending.lent == (0 if writes else 1)
        inbox.own()
        writer.close()


def test_a_lent_slot_never_lends_where_the_parameters_are_written() -> None:
    """Rows of a shard (K > 1) and a GPU's inbox are never lent; neither are the downlink's mirror and local steps'
    replicas (SlotLending `allowed` false: services/worker/links/intake.py)."""
    params = _model(64)
    assert not Inbox(Partition(params, shards=2), params, {}, torch.device("cpu")).lends
    assert SlotLending(Inbox(Partition(params), params, {}, torch.device("cpu")), None, params, False,
                       _Log()).mode is Lend.COPY


def test_a_gradient_computed_on_a_rewritten_slot_is_stale_not_the_users_divergence() -> None:
    """Parameters torn by a rewrite can give a NaN: that is never reported as the run's divergence."""
    cfg = load_config(DIGITS, ["train.microbatches=1"])
    model = torch.nn.Linear(64, 10)
    dataset = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    runner = MicrobatchRunner(cfg, model, dataset, torch.nn.functional.cross_entropy)
    fatal: list[str] = []
    quiet = SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: print(a, k))
    compute = BlockComputer(cfg, runner, quiet, fatal.append, lambda: "w0")
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    compute.valid = lambda: False
    with pytest.raises(StaleParameters):
        compute.block(0, 0, 1, 1.0)
    assert fatal == []
    compute.valid = lambda: True
    compute.block(0, 0, 1, 1.0)
    assert fatal and "not finite" in fatal[0]


# ---------------------------------------------------------------------------------------------- real clusters

def _worker_lines(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("worker-*.log")))


@pytest.mark.integration
@pytest.mark.parametrize("hidden, lent", [(128, True), (2304, True), (2302, False)])
def test_workers_compute_in_the_slot_and_give_the_reference(tmp_path: Path, hidden: int, lent: bool) -> None:
    """digits (one flat frame), a 21 MB MLP whose tensors are cut in pieces back to back in the slot, and one whose
    pieces are not (rows of 2302 floats): two same-host workers, bitwise `cmemi reference`."""
    sets = (*FAST, "train.steps=12", "scheduler.kwargs.T_max=12", f"model.kwargs.hidden={hidden}", "cluster.workers=2",
            "train.microbatches=2")
    want = reference_sha(tmp_path, *sets)
    r = run_up(tmp_path / "run", *sets)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary["params_sha256"] == want
    lines = _worker_lines(tmp_path / "run")
    assert ("parameters are read in place from the leader's slot" in lines) is lent, lines[-2000:]
    # logged only where `Inbox.lend` made the model's parameters views of the slot (the line above comes before it)
    assert ("a version lent: the model computes in the leader's slot" in lines) is lent, lines[-2000:]
    assert ("does not hold each tensor in one run" in lines) is not lent


@pytest.mark.integration
def test_a_model_that_writes_its_parameters_is_copied_and_trains_as_over_tcp(tmp_path: Path) -> None:
    """A forward pass that clips its weights in place: over slots it would write into read-only memory (a segmentation
    fault); the first version shows it, and every version is copied: the same bits as over tcp://."""
    sets = (*FAST, "train.steps=12", "scheduler.kwargs.T_max=12", "model.factory=tests.helpers.fixtures:clamping_mlp",
            "cluster.workers=2", "train.microbatches=2")
    runs = {t: run_up(tmp_path / t, *sets, f"cluster.transport={t}") for t in ("auto", "tcp")}
    for r in runs.values():
        assert r.rc == 0, r.stderr[-3000:]
    assert runs["auto"].summary["params_sha256"] == runs["tcp"].summary["params_sha256"]
    lines = _worker_lines(tmp_path / "auto")
    assert "writes its parameters" in lines and "parameters are read in place" not in lines
