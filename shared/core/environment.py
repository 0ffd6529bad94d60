"""What changes the bits of a gradient besides the data: the worker says it in its hello.

Two workers computing the same microbatch give the same bits only with the same torch build, the same
intra-op thread count (reduction order), the same CPU kernels (instruction set torch dispatches to) or
the same GPU model. The aggregator compares each worker's environment with its own (torch, threads,
CPU instruction set) and with the first admitted worker's (device kind, GPU model).
"""

from __future__ import annotations

from typing import Any

import torch

OWN = ("torch", "threads", "cpu")  # compared with the aggregator's
SHARED = ("device", "gpu")  # compared with the first admitted worker's


def environment(device: torch.device, cfg: Any) -> dict[str, str]:
    env = {"torch": torch.__version__, "threads": str(cfg.cluster.threads_per_worker),
           "cpu": torch.backends.cpu.get_cpu_capability(), "device": device.type, "gpu": ""}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def differences(got: Any, want: dict[str, str], fields: tuple[str, ...]) -> list[str]:
    """'field X here, Y there' for each field that differs (a missing or malformed env differs in all)."""
    if not isinstance(got, dict):
        return ["no environment in its hello (an older cmemi?)"]
    return [f"{f} {got.get(f)!s:.40} (expected {want[f]})" for f in fields if str(got.get(f)) != want[f]]
