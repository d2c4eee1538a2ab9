"""Bad input on a live run (issue 9 item 7): every kind of malformed record on every topic a run reads
lands in the dead letters, with its reason, from every consumer group that reads it; nothing
crashes or restarts, and the run finishes. The injector and the accounting are benchmarks/bad_input.py's."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _bad_input():
    spec = importlib.util.spec_from_file_location("bad_input_bench", ROOT / "benchmarks" / "bad_input.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


STEPS = 30
"""Enough for the trainer to read the batch injected after step 1: on a quiet machine a tiny step takes
~0.1 s, and with 6 steps the trainer had finished before the garbage batch was on its topic."""


def test_bad_records_on_every_topic_are_dead_lettered_and_the_run_finishes(tmp_path: Path, test_cluster) -> None:
    bench = _bad_input()
    t0 = time.monotonic()
    result = bench.live_run(test_cluster, tmp_path, steps=STEPS, timeout_s=100)
    out = result["_output"]
    assert result["run_finished"], out
    assert result["trainer_steps"] == STEPS, out
    assert result["restarts"] == 0, [r for r in result["_records"] if r.get("kind") == "supervisor"]
    topics = {"tasks.default", "trajectories", "batches.policy", "weights.policy", "metrics"}
    assert set(result["topics"]) == topics
    readers = bench.run_topics(test_cluster.run, "default", "policy")
    for rec in result["_injected"]:
        for marker in readers[rec.topic][3]:
            got = [reason for group, reason in rec.dead_letters.items() if group.startswith(marker)]
            assert got, f"{rec.topic} {rec.kind}: not dead-lettered by {marker}* (got {rec.dead_letters})"
            assert set(got) == {bench.EXPECTED_REASON[rec.kind]}, f"{rec.topic} {rec.kind}: {rec.dead_letters}"
    assert result["injected"] == len(topics) * len(bench.KINDS) == result["dead_lettered"]
    assert result["missing"] == result["wrong_reason"] == 0
    assert time.monotonic() - t0 < 150
