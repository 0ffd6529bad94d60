"""The ResNet example's accuracy line (scripts/resnet_accuracy.py's docs/resnet_accuracy.json), for
docs/guides/buffers.md."""

from __future__ import annotations

from scripts.tables import provenance
from scripts.tables.provenance import load_path, measured


def resnet_accuracy() -> str:
    """The ResNet example's accuracy line, from docs/resnet_accuracy.json (scripts/resnet_accuracy.py)."""
    d = load_path(provenance.RESNET)

    def pct(xs: list[float]) -> str:
        return " / ".join(f"{x * 100:.1f}" for x in xs)

    return (f"- **Accuracy of the example** (`{d.get('command', 'python scripts/resnet_accuracy.py')}`, "
            f"seeds {', '.join(map(str, d['seeds']))}, test accuracy in eval mode): CMEMI (`cmemi reference`, bitwise "
            f"`cmemi up`) {pct(d['cmemi_reference'])} %, mean **{d['cmemi_mean'] * 100:.1f} %**; a plain PyTorch loop "
            f"(tests/helpers/plain.py) {pct(d['plain_pytorch'])} %, mean **{d['plain_mean'] * 100:.1f} %**. "
            + measured(paths=(provenance.RESNET,)))
