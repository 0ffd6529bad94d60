"""Loading a config: YAML file, then `CMEMI__*` environment overrides, then `--set a.b=c` overrides, then a typed
build of the schema's dataclasses (every value checked against its field's annotation before the section's own
checks run). `load_config` is the single source of truth; `dump_config` is what a run saves.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from cmemi.shared.config.checks import ConfigError, fail
from cmemi.shared.config.schema import Config


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _build(cls: Any, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        fail(prefix or "<root>", data, "must be a mapping", f"write {prefix or 'the file'} as 'key: value' lines")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(f"config: unknown key '{_join(prefix, unknown[0])}' in {where}; "
                          f"valid keys are: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        path = _join(prefix, name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, {} if value is None else value, path)
        elif not _type_ok(value, tp):
            fail(path, value, f"expected {_type_name(tp)}, got {type(value).__name__}", f"set {path} to a {_type_name(tp)}")
        else:
            kwargs[name] = float(value) if tp is float else value
    return cls(**kwargs)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set cluster.workers=3")
    key, text = item.split("=", 1)
    value = yaml.load(text, Loader=_Loader) if text else None
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: '{part}' is not a section")
    node[parts[-1]] = value


ENV_PREFIX = "CMEMI__"


def env_overrides(environ: dict[str, str] | None = None) -> list[str]:
    """`CMEMI__CLUSTER__REDIS=redis://...` becomes the override `cluster.redis=redis://...`."""
    environ = dict(os.environ) if environ is None else environ
    return [f"{k[len(ENV_PREFIX):].lower().replace('__', '.')}={v}"
            for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIX)]


def config_from_dict(raw: dict[str, Any], overrides: Sequence[str] = ()) -> Config:
    raw = _deepcopy(raw)
    for item in overrides:
        _apply_override(raw, item)
    cfg: Config = _build(Config, raw, "")
    return cfg


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads 3e-3 as a string; read it as the float every user means (as YAML 1.2 does)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_config(path: str | Path, overrides: Sequence[str] = (), environ: dict[str, str] | None = None) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass the path of a YAML file, e.g. examples/digits.yaml")
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}".replace("\n", " ")) from None
    return config_from_dict(raw, [*env_overrides(environ), *overrides])


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _deepcopy(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _deepcopy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deepcopy(v) for v in raw]
    return raw
