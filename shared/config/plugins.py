"""User code plugs in by import path ('module:attribute'); a failed lookup lists the choices."""

from __future__ import annotations

import inspect
import json
import re
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from cmemi.shared.config import initweights
from cmemi.shared.config.checks import ConfigError
from cmemi.shared.config.lookup import resolve
from cmemi.shared.config.schema import Config
from cmemi.shared.config.training import OptimizerConfig
from cmemi.shared.config.usercode import describe
from cmemi.shared.runtime import prebuilt
from cmemi.shared.wire import limits

P = TypeVar("P")  # a parameter, or anything standing for one (the servers' reshard numbers piece names)


def _class_in(namespace: Any, base: type, name: str, field: str) -> type:
    if ":" in name:
        own: type = resolve(name, field)
        return own
    cls = getattr(namespace, name, None)
    if inspect.isclass(cls) and issubclass(cls, base) and cls is not base:
        return cls
    choices = sorted(n for n, c in vars(namespace).items()
                     if inspect.isclass(c) and issubclass(c, base) and c is not base and not n.startswith("_"))
    raise ConfigError(f"config field '{field}' = {name!r} is not a {namespace.__name__} class; "
                      f"available: {', '.join(choices)} (or 'module:Class' for your own)")


class FactoryError(ConfigError):
    """The model factory raised: the same on every try, so said once (exit 2), not restarted."""


def user_modules(cfg: Config) -> list[str]:
    """The modules the config's import paths name (model, data, loss, evaluation, own optimizer or scheduler)."""
    paths = [cfg.model.factory, cfg.data.factory, cfg.train.loss, cfg.eval.fn, cfg.optimizer.name, cfg.scheduler.name]
    return list(dict.fromkeys(p.partition(":")[0] for p in paths if p and ":" in p))


def data_key(cfg: Config) -> str:
    """What the training dataset is built from (shared/runtime/prebuilt.py): its factory and kwargs, and the model's
    with the seed before them (they set torch's generator where the dataset factory finds it)."""
    return json.dumps([cfg.model.factory, cfg.model.kwargs, cfg.run.seed, cfg.data.factory, cfg.data.kwargs],
                      sort_keys=True, default=repr)


def build_model(cfg: Config) -> torch.nn.Module:
    """Build the model with the run's seed, so every process starts from identical weights. The factory runs as
    in a plain script (no meta device, no patched defaults); the model's size sizes messages (shared/wire/limits.py)."""
    factory = resolve(cfg.model.factory, "model.factory")
    torch.manual_seed(cfg.run.seed)
    try:
        model = factory(**cfg.model.kwargs)
    except Exception as exc:  # user code may raise anything: one line with the function and its file:line
        raise FactoryError(f"config field 'model.factory': {cfg.model.factory}(**{cfg.model.kwargs}) raised "
                           f"{describe(exc).line()}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"config field 'model.factory' = {cfg.model.factory!r} returned {type(model).__name__}, "
                          "not a torch.nn.Module; return the model from the factory")
    limits.record(cfg, model)
    return model


def build_dataset(cfg: Config) -> Any:
    """The training dataset: the zygote's when it built this one (cluster.zygote_data), else data.factory's call.
    Raises what the factory raises (the caller says it in one line: shared/core/data.py data_error)."""
    taken, dataset = prebuilt.take("dataset", data_key(cfg))
    return dataset if taken else resolve(cfg.data.factory, "data.factory")(**cfg.data.kwargs)


def param_groups(spec: OptimizerConfig, named: Mapping[str, P]) -> list[dict[str, Any]]:
    """Split parameters by the first param_groups regex of `spec` (an optimizer section) matching their name; the
    rest: default group."""
    groups: list[dict[str, Any]] = [{**{k: v for k, v in g.items() if k != "match"}, "params": []}
                                    for g in spec.param_groups]
    default: list[P] = []
    for name, p in named.items():
        for spec_group, group in zip(spec.param_groups, groups, strict=True):
            if re.search(spec_group["match"], name):
                group["params"].append(p)
                break
        else:
            default.append(p)
    return [g for g in [{"params": default}, *groups] if g["params"]]


def build_optimizer(cfg: Config, params: Any, section: str = "optimizer") -> torch.optim.Optimizer:
    """`params`: a dict name -> parameter (param_groups apply) or any iterable torch.optim accepts. `section`: which
    of the config's optimizers (`outer_optimizer`: the servers' with train.local_steps)."""
    spec: OptimizerConfig = getattr(cfg, section)
    cls = _class_in(torch.optim, torch.optim.Optimizer, spec.name, f"{section}.name")
    if isinstance(params, dict):
        params = param_groups(spec, params) if spec.param_groups else list(params.values())
    kwargs = dict(spec.kwargs)
    accepted = inspect.signature(cls).parameters
    if not {"foreach", "fused"} & kwargs.keys():
        params = list(params)  # used twice when the fused kernel is refused
        if "fused" in accepted:  # one kernel for all tensors: Adam on a small MLP 0.21 ms a step against 0.53 (foreach)
            try:
                fused: torch.optim.Optimizer = cls(params, **kwargs, fused=True)
                return fused
            except (RuntimeError, TypeError, ValueError):  # not for these dtypes/devices/options: foreach below
                pass
        if "foreach" in accepted:
            kwargs["foreach"] = True  # one kernel per op and group, not a Python loop per tensor
    try:
        optimizer: torch.optim.Optimizer = cls(params, **kwargs)
        return optimizer
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config field '{section}.kwargs' = {spec.kwargs!r} rejected by "
                          f"{cls.__name__}: {exc}") from None


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> Any:
    if cfg.scheduler.name is None:
        return None
    base = torch.optim.lr_scheduler.LRScheduler
    cls = _class_in(torch.optim.lr_scheduler, base, cfg.scheduler.name, "scheduler.name")
    try:
        return cls(optimizer, **cfg.scheduler.kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config field 'scheduler.kwargs' = {cfg.scheduler.kwargs!r} rejected by "
                          f"{cls.__name__}: {exc}") from None


def check_plugins(cfg: Config) -> None:
    """Resolve every import path once, so a typo fails at `cmemi up` and not inside a worker."""
    resolve(cfg.model.factory, "model.factory")
    resolve(cfg.data.factory, "data.factory")
    check_signature(resolve(cfg.train.loss, "train.loss"), "train.loss", cfg.train.loss, "loss(output, target)", 2)
    if cfg.eval.fn:
        check_signature(resolve(cfg.eval.fn, "eval.fn"), "eval.fn", cfg.eval.fn, "evaluate(model) -> dict", 1)
    model = build_model(cfg)
    if cfg.model.init_from:  # a missing file or (strict) a mismatch fails here, in seconds, before any service
        initweights.say_skipped(cfg.model.init_from, initweights.load_into(model, cfg.model.init_from,
                                                                           cfg.model.init_strict))
    opt = build_optimizer(cfg, dict(model.named_parameters()))
    build_scheduler(cfg, opt)
    if cfg.train.local_steps:
        build_optimizer(cfg, dict(model.named_parameters()), "outer_optimizer")
    dry_run_schedule(cfg)


def check_signature(fn: Any, field: str, path: str, expected: str, positional: int) -> None:
    """Can `fn` be called with `positional` positional arguments? Fails at start-up, naming the function."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        sig.bind(*range(positional))
    except TypeError as exc:
        code = getattr(inspect.unwrap(fn), "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise ConfigError(f"config field '{field}' = {path!r}: {getattr(fn, '__name__', path)}{sig}{where} cannot be "
                          f"called as {expected} ({exc}); change it to take {positional} argument"
                          f"{'s' if positional > 1 else ''}") from None


def dry_run_schedule(cfg: Config) -> None:
    """Step a throwaway optimizer/scheduler pair train.steps times: a schedule too short for the run
    (OneCycleLR's total_steps, say) fails here, in one line, not on the aggregator mid-run."""
    if cfg.scheduler.name is None:
        return
    opt = build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    sched = build_scheduler(cfg, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(cfg.train.steps):
            try:
                opt.step()
                sched.step()
            except Exception as exc:  # any scheduler's own error, reported with the step it happens at
                raise ConfigError(f"config field 'scheduler.kwargs' = {cfg.scheduler.kwargs!r}: {cfg.scheduler.name} "
                                  f"fails at step {step + 1} of train.steps={cfg.train.steps} ({exc}); make the "
                                  "schedule cover every step (e.g. total_steps >= train.steps)") from None
