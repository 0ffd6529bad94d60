"""Which device a worker computes on (the CUDA choices with torch.cuda faked: no GPU on the test machine)."""

from __future__ import annotations

import pytest
import torch
from cmemi.services.worker.compute.device import DeviceError, pick_device, to_device


def test_cpu_and_auto_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("cpu", "w0") == torch.device("cpu")
    assert pick_device("auto", "w3") == torch.device("cpu")
    with pytest.raises(DeviceError, match="sees no CUDA GPU"):
        pick_device("cuda", "w0")
    batch = (torch.ones(2), [torch.zeros(1)], {"k": torch.ones(1)})
    assert to_device(batch, torch.device("cpu")) is batch


def test_one_gpu_per_worker_by_its_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [pick_device("cuda", f"w{i}").index for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert pick_device("auto", "w2") == torch.device("cuda", 2)
    assert pick_device("cuda:3", "w0") == torch.device("cuda", 3)
    assert 0 <= pick_device("cuda", "host-a").index < 4  # an id without a number: a stable hash
    assert pick_device("cuda", "host-a") == pick_device("cuda", "host-a")
    with pytest.raises(DeviceError, match="has 4 GPU"):
        pick_device("cuda:4", "w0")
