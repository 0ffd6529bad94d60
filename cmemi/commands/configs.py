"""Where a config argument points: a YAML path, or the name of an example installed with the package.

Below `cmemi/cli.py` and every command that takes a config (`cmemi reference`, the zygote), so none of
them imports the command line to find a file.
"""

from __future__ import annotations

from pathlib import Path


def examples_dir() -> Path:
    import cmemi.examples

    return Path(cmemi.examples.__file__).resolve().parent


def bundled_examples() -> list[str]:
    """Names of the example configs installed with the package (`cmemi up digits` runs examples/digits.yaml)."""
    return sorted(p.stem for p in examples_dir().glob("*.yaml"))


def config_path(arg: str) -> str:
    """A config argument: a YAML path, or (when no such file exists) the name of a bundled example."""
    if Path(arg).exists() or Path(arg).suffix in (".yaml", ".yml"):
        return arg
    bundled = examples_dir() / f"{arg}.yaml"
    return str(bundled) if bundled.is_file() else arg
