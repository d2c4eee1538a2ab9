"""Bad input on a live run (issue 9 item 7): every kind of malformed record on every topic a run reads
lands in the dead letters, with its reason, from every consumer group that reads it; nothing
crashes or restarts, and the run finishes. The injector and the accounting are
astraflow.testing.bad_records's (shared with benchmarks/bad_input.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from astraflow.records.control import SupervisorEvent
from astraflow.report.plot import typed_records
from astraflow.testing import bad_records

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.integration, pytest.mark.slow]


STEPS = 30
"""Enough for the trainer to read the batch injected after step 1: on a quiet machine a tiny step takes
~0.1 s, and with 6 steps the trainer had finished before the garbage batch was on its topic."""


def test_bad_records_on_every_topic_are_dead_lettered_and_the_run_finishes(tmp_path: Path, test_cluster) -> None:
    t0 = time.monotonic()
    result = bad_records.live_run(test_cluster, tmp_path, base_recipe=ROOT / "examples" / "recipes" / "math.yaml",
                                  model=ROOT / "examples" / "models" / "tiny.yaml", steps=STEPS, timeout_s=100)
    out = result["_output"]
    assert result["run_finished"], out
    assert result["trainer_steps"] == STEPS, out
    assert result["restarts"] == 0, [r for r in typed_records(result["_records"]) if isinstance(r, SupervisorEvent)]
    topics = {"tasks.default", "trajectories", "batches.policy", "weights.policy", "metrics"}
    assert set(result["topics"]) == topics
    readers = bad_records.run_topics(test_cluster.run, "default", "policy")
    for rec in result["_injected"]:
        for marker in readers[rec.topic][3]:
            got = [reason for group, reason in rec.dead_letters.items() if group.startswith(marker)]
            assert got, f"{rec.topic} {rec.kind}: not dead-lettered by {marker}* (got {rec.dead_letters})"
            assert set(got) == {bad_records.EXPECTED_REASON[rec.kind]}, f"{rec.topic} {rec.kind}: {rec.dead_letters}"
    assert result["injected"] == len(topics) * len(bad_records.KINDS) == result["dead_lettered"]
    assert result["missing"] == result["wrong_reason"] == 0
    assert time.monotonic() - t0 < 150
