"""`cmemi checkpoints list|verify|export RUN_DIR`: inspect, check and export a run's checkpoints.

`export --format hf` writes a Hugging Face save_pretrained directory instead of one file: hf_export.py."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from cmemi.services.checkpointer.store import CheckpointStore
from cmemi.shared.runtime.exits import Exit


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cmemi checkpoints", description=__doc__)
    sub = p.add_subparsers(dest="action", required=True)
    for name, help_ in (("list", "step, size and age of each checkpoint"),
                        ("verify", "check every file against its manifest checksum (exit 1 if any is damaged)"),
                        ("export", "write one checkpoint's model weights as a single file (--format hf: a Hugging "
                                   "Face model directory of the run's final weights)")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("run_dir")
    exp = sub.choices["export"]
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest that verifies)")
    exp.add_argument("-o", "--output", default=None, help="output file (default RUN_DIR/export-step-N.safetensors; "
                     "--format hf: a directory, default RUN_DIR/export-hf)")
    exp.add_argument("--format", choices=["safetensors", "pt", "hf"], default="safetensors",
                     help="safetensors (safetensors.torch.load_file), pt (torch.load(path, weights_only=True)) or hf "
                     "(a save_pretrained directory for transformers' from_pretrained: the run's final weights, else "
                     "its newest checkpoint; needs cmemi[hf] and a transformers model)")
    args = p.parse_args(argv)
    if args.action == "export" and args.format == "hf":
        from cmemi.commands import hf_export

        return hf_export.main(args.run_dir, args.output, args.step)
    root = Path(args.run_dir) / "checkpoints"
    if not root.is_dir():
        print(f"cmemi: error: {root} not found; pass the run directory of a cmemi run", file=sys.stderr)
        return Exit.FATAL
    store = CheckpointStore(root)
    infos = store.list()
    if args.action == "list":
        print(f"{'step':>8}  {'size':>10}  {'age':>8}  path")
        for i in infos:
            print(f"{i.step:>8}  {_human(i.bytes):>10}  {time.time() - i.mtime:>7.0f}s  {i.path}")
        return 0
    if args.action == "verify":
        bad = 0
        for i in infos:
            problem = store.verify(i.path)
            print(f"step {i.step:>8}: {'ok' if problem is None else 'DAMAGED: ' + problem}")
            bad += problem is not None
        print(f"{len(infos) - bad} of {len(infos)} checkpoints verify")
        return 1 if bad else 0
    # export
    if args.step is None:
        info = store.latest_good()
        if info is None:
            print("cmemi: error: no checkpoint verifies; nothing to export", file=sys.stderr)
            return 1
    else:
        info = next((i for i in infos if i.step == args.step), None)
        if info is None:
            print(f"cmemi: error: no checkpoint of step {args.step}; have: {[i.step for i in infos]}", file=sys.stderr)
            return Exit.FATAL
        problem = store.verify(info.path)
        if problem:
            print(f"cmemi: error: checkpoint of step {info.step} is damaged: {problem}", file=sys.stderr)
            return 1
    ext = "safetensors" if args.format == "safetensors" else "pt"
    out = Path(args.output or Path(args.run_dir) / f"export-step-{info.step}.{ext}")
    if args.format == "safetensors":
        shutil.copyfile(info.path / "model.safetensors", out)
    else:
        import torch
        from safetensors.torch import load_file

        torch.save(load_file(str(info.path / "model.safetensors")), out)
    print(f"exported step {info.step} model weights to {out}")
    return 0
