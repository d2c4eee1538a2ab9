"""benchmarks/gpu_rollout.py, the device plan's main measurement (scripts/device/gpu_checks.sh rollout),
runs end to end on the CPU with the tiny model: every path prints its figures, its log-probs match
teacher forcing and its weight refreshes land between two steps; vLLM is measured where it is
installed and reported skipped where it is not. (The GPU figures come only from the GPU machine.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from connectors.vllm.config import vllm_available

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_the_rollout_benchmark_measures_every_path_in_one_run():
    cmd = [sys.executable, "benchmarks/gpu_rollout.py", "--model", "examples/models/tiny.yaml", "--paths",
           "graphs,eager,vllm", "--rows", "1,2", "--tokens", "6", "--prompt-tokens", "8", "--reps", "1",
           "--refresh-rows", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    for path in ("graphs", "eager"):
        figures = result[path]
        assert figures["rows1"]["tokens_per_s"] > 0 and figures["rows2"]["tokens_per_s"] > 0
        assert figures["logprob_max_abs_err"] < 1e-4
        assert figures["refresh_patch_landed_between_steps"] and figures["refresh_full_landed_between_steps"]
    assert set(result["over_eager"]) >= {"graphs"}
    if vllm_available():
        assert result["vllm"]["refresh_full_tagged"] and result["vllm"]["rows2"]["tokens_per_s"] > 0
    else:
        assert result["vllm"] == {"skipped": "vllm is not importable in this Python"}
