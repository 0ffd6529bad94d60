"""One microbatch's gradient (and the buffers its forward produced): the worker's computation, shared
with the single-process reference (`cmemi reference`) so both compute the same bits.

Every microbatch starts from the step's buffers; its data is read with every global RNG seeded from the
data stream of (seed, step, m) (here, or ahead in a loader process), and the model stream is seeded before
the forward pass: augmentation in `__getitem__` and dropout are the same bits on any worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cmemi.services.worker.compute.device import to_device
from cmemi.shared.config.schema import Config
from cmemi.shared.config.usercode import RemoteFailure
from cmemi.shared.core import buffers as buffer_rule
from cmemi.shared.core.data import read_microbatch, seed_microbatch
from cmemi.shared.errors import UserError


class UserCodeError(UserError, RuntimeError):
    """User code (dataset, collate, model, loss) raised while computing a microbatch; `phase` says which."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase}: {cause}")
        self.phase, self.cause = phase, cause


def output_hint(out: Any) -> str:
    """What to change when the loss got a model output that is not a tensor but holds one: a `transformers`
    model returns a ModelOutput whose `.logits` the loss must read (examples/hf_lm.py's loss does)."""
    if isinstance(out, torch.Tensor) or not hasattr(out, "logits"):
        return ""
    return (f" (the model returned a {type(out).__name__}, not a tensor: write a train.loss that reads its .logits, "
            "as examples/hf_lm.py:loss does)")


def _nothing() -> None:
    pass


class MicrobatchRunner:
    def __init__(self, cfg: Config, model: torch.nn.Module, dataset: Any, loss_fn: Any) -> None:
        self.cfg, self.model, self.dataset, self.loss_fn = cfg, model, dataset, loss_fn
        self.n = len(dataset)
        self.device = torch.device("cpu")
        self.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.params: dict[str, torch.Tensor] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.buffers = buffer_rule.travelling(model)  # the model's live buffers
        # The step's starting buffers (CPU): every microbatch starts from these; new versions land here.
        self.step_buffers = {n: b.detach().clone() for n, b in self.buffers.items()}
        self.report_buffers = bool(self.buffers) and cfg.model.buffers == "mean"
        self.loader: Any = None  # a services.worker.loader.Loader when data.workers > 0: batches read ahead
        # While set (by a block, services/worker/compute/block.py), each parameter's gradient is handed to `take` the moment
        # backward has accumulated it, and dropped here: it is folded into the block's sum while backward goes on,
        # so no whole second gradient is ever held. `taken`: the names handed over in this backward.
        self.take: Callable[[str, torch.Tensor], None] | None = None
        self.taken: set[str] = set()
        self.twice = False  # a gradient accumulated twice in one backward (reentrant checkpointing): see _taker
        self.hooked = False  # the hooks `take` needs, registered by the first block that folds (`hook`)

    def hook(self) -> None:
        """Register the hooks that hand each gradient to `take`, once, when a block first folds: a model too small to
        fold (block.py FOLD_MIN_BYTES) never pays a Python call per parameter per backward pass for them."""
        if not self.hooked:
            for name, p in self.params.items():
                p.register_post_accumulate_grad_hook(self._taker(name))
            self.hooked = True

    def _taker(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self.take is None or self.twice or p.grad is None:
                return
            if name in self.taken:
                # Its first part was handed over as if final: the sum's bracketing is broken. Stop handing over;
                # the block sees `twice` and computes again without `take` (services/worker/compute/block.py).
                self.twice = True
                return
            self.taken.add(name)
            self.take(name, p.grad)
            p.grad = None

        return hook

    def to(self, device: torch.device) -> None:
        self.device = device
        self.model.to(device)
        self.buffers = buffer_rule.travelling(self.model)
        if device.type == "cuda":
            self.step_buffers = {n: b.pin_memory() for n, b in self.step_buffers.items()}

    def run(self, step: int, m: int, scale: float = 1.0) -> tuple[float, dict[str, torch.Tensor],
                                                                  dict[str, torch.Tensor] | None]:
        """(loss, gradient unscaled, buffers produced or None) of microbatch (step, m); fp16: the loss is
        multiplied by `scale` first. Raises UserCodeError when user code raises."""
        self.reset_buffers()
        return self.run_on(step, m, scale)

    def reset_buffers(self) -> None:
        """The model's buffers back to the step's (every microbatch, and every replica's round, starts from them)."""
        if self.buffers:
            with torch.no_grad():
                for n, b in self.buffers.items():
                    b.copy_(self.step_buffers[n])

    def run_on(self, step: int, m: int, scale: float = 1.0) -> tuple[float, dict[str, torch.Tensor],
                                                                      dict[str, torch.Tensor] | None]:
        """`run` from the model's buffers as they are (a replica's inner steps carry them on, services/worker/compute/local.py)."""
        batch, release = self._read(step, m)
        try:
            return self._compute(step, m, scale, batch)
        finally:
            release()

    def _read(self, step: int, m: int) -> tuple[Any, Any]:
        """The batch of (step, m), from a loader when one has it, else read here (the same bits either way)."""
        where = f"reading microbatch {m} of step {step} ({self.cfg.data.factory}, collate)"
        if self.loader is not None:
            try:
                got = self.loader.get(step, m)
            except RemoteFailure as exc:
                raise UserCodeError(where, exc) from None
            if got is not None:
                return got
        try:
            return read_microbatch(self.cfg, self.dataset, self.n, step, m), _nothing
        except Exception as exc:  # __getitem__ or collate
            raise UserCodeError(where, exc) from exc

    def _compute(self, step: int, m: int, scale: float, batch: Any) -> tuple[float, dict[str, torch.Tensor],
                                                                           dict[str, torch.Tensor] | None]:
        cfg = self.cfg
        seed_microbatch(cfg.run.seed, step, m, self.device)  # the model's stream (dropout), after the data's
        try:
            x, y = to_device(batch, self.device)
        except Exception as exc:  # not an (x, y) pair
            raise UserCodeError(f"reading microbatch {m} of step {step} ({cfg.data.factory}, collate)", exc) from exc
        for p in self.params.values():
            p.grad = None
        self.taken = set()
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            try:
                out = self.model(x)
            except Exception as exc:
                raise UserCodeError(f"forward pass of {cfg.model.factory} on microbatch {m} of step {step}",
                                    exc) from exc
            try:
                loss = self.loss_fn(out, y)
            except Exception as exc:
                raise UserCodeError(f"loss {cfg.train.loss} on microbatch {m} of step {step}{output_hint(out)}",
                                    exc) from exc
        M = cfg.train.microbatches
        try:
            if cfg.precision == "fp16":
                # Scale by scale/M: fp16 intermediates then have the magnitudes of a single-process run over
                # the whole global batch, so overflows happen exactly where torch.amp.GradScaler sees them.
                (loss.float() * (scale / M)).backward()
            else:
                loss.backward()
        except Exception as exc:
            raise UserCodeError(f"backward pass on microbatch {m} of step {step}", exc) from exc
        # what `take` did not get: every gradient, or (taking) those of parameters backward did not reach
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.params.items()
                 if n not in self.taken}
        for p in self.params.values():
            p.grad = None  # the gradient is `grads`' now: a stale one kept here would be a whole extra P until next time
        if cfg.precision == "fp16":
            for g in grads.values():
                g.mul_(M / scale)
        produced = ({n: b.detach().to("cpu", copy=True) for n, b in self.buffers.items()}
                    if self.report_buffers else None)
        return float(loss.detach()), grads, produced
