"""Looking up user code by import path ('package.module:attr'): a failed lookup names the config field and lists the
choices. Its own module because both the plugins (plugins.py) and the message limits' measuring child
(shared/wire/limits.py) need it, and plugins.build_model records the model's size in the limits."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from cmemi.shared.config.checks import ConfigError
from cmemi.shared.errors import UserError


def resolve(path: str, field: str) -> Any:
    """Import 'package.module:attr' (attr may be dotted). Errors name the config field and list what exists."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"config field '{field}' = {path!r}: cannot import module {module_name!r} ({exc}); "
                          "check the spelling and that the package is installed or on PYTHONPATH") from None
    except UserError as exc:  # the module says itself what is wrong (extras.MissingExtra: "pip install 'cmemi[hf]'")
        raise ConfigError(f"config field '{field}' = {path!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            close = difflib.get_close_matches(part, public, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"config field '{field}' = {path!r}: {module_name!r} has no attribute {part!r}.{hint} "
                              f"Available: {', '.join(public[:40]) or '(nothing callable)'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"config field '{field}' = {path!r} is a {type(obj).__name__}, not a function or class")
    return obj
