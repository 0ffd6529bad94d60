"""Measure examples/resnet.yaml: test accuracy of `cmemi reference` (bitwise what `cmemi up` gives) against an
independent plain PyTorch loop (tests/helpers/plain.py), 3 seeds each. Writes docs/resnet_accuracy.json (with the commit and
date it was measured at), from which scripts/readme_tables.py generates the manual's accuracy line (docs/guides/buffers.md):
`python scripts/resnet_accuracy.py`."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cmemi.shared.config.loading import load_config  # noqa: E402

from bench.common import provenance  # noqa: E402
from cmemi.commands.reference import train  # noqa: E402
from tests.helpers.plain import plain_loop  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    measured = provenance()  # the commit, dirty flag and date, taken before the runs
    config = str(ROOT / "examples" / "resnet.yaml")
    cmemi = [train(load_config(config, [f"run.seed={s}"]))[1]["eval"]["accuracy"] for s in range(3)]
    plain = [plain_loop(load_config(config), s)["accuracy"] for s in range(3)]
    result = {**measured, "command": "python scripts/resnet_accuracy.py", "config": "examples/resnet.yaml", "seeds": [0, 1, 2], "cmemi_reference": cmemi, "plain_pytorch": plain,
              "cmemi_mean": statistics.mean(cmemi), "plain_mean": statistics.mean(plain)}
    (ROOT / "docs" / "resnet_accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
