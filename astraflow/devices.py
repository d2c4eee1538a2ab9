"""How a torch device is named in the logs: the GPU's model beside a CUDA device."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def describe(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H200)``: which card a run used, read from its logs."""
    import torch

    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"
