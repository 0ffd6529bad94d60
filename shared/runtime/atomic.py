"""Files that are either the old version or the new one, never half of either, even across a power loss:
write a temporary file in the same directory, fsync it, rename it over the target, fsync the directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, target: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(target.parent)


def write_text(target: Path, text: str) -> None:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        _replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def copy_file(src: Path, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(src, tmp)
        _replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
