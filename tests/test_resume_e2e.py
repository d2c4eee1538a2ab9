"""End to end: a run stopped with SIGTERM on an embedded stack whose log is in memory (so the log dies
with the stop), then ``astraflow run RECIPE --run-id <same>`` on a fresh stack: it resumes from the
bucket checkpoints, finishes to its target step, and trains no checkpointed batch again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from e2e_helpers import LauncherProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 12
"""The first run is stopped at step 3; a tiny step takes ~0.1 s on a quiet machine, so it needs room
to still be running when the test sees step 3."""


def _memory_log_env(state_dir: Path) -> dict[str, str]:
    """No cluster configured: the launcher starts (and owns) an embedded stack in ``state_dir``, its
    log in memory; the bucket (SeaweedFS data under ``state_dir``) survives the stop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env.update(ASTRAFLOW_STATE_DIR=str(state_dir), ASTRAFLOW_LOG_STORAGE="memory")
    return env


def _steps(records: list[dict], life: str | None = None) -> list[dict]:
    return [r for r in records if r.get("component") == "trainer" and "batch_id" in r and not r.get("event")
            and (life is None or r.get("life") == life)]


def test_resume_after_the_log_was_lost_finishes_without_retraining(tmp_path: Path) -> None:
    env = _memory_log_env(tmp_path / "state")
    first = LauncherProcess(tmp_path, "lost-log", env, STEPS)
    first.wait_for_step(3, timeout_s=120)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(60) == 130, first.output[-3000:]
    before = first.records()
    trained_1 = {r["step"]: r["batch_id"] for r in _steps(before)}

    t0 = time.monotonic()
    second = LauncherProcess(tmp_path, "lost-log", env, STEPS)
    rc = second.wait(150)
    wall = time.monotonic() - t0
    assert rc == 0, second.output[-3000:]
    after = second.records()[len(before):]
    start = next(r for r in after if r.get("component") == "trainer" and r.get("event") == "start")
    assert start["origin"].startswith("checkpoint step "), start
    ckpt_step = start["step"]
    checkpointed = {b for s, b in trained_1.items() if s <= ckpt_step}
    resumed = _steps(after, start["life"])
    # every step after the checkpoint, once, up to the target, with batches never trained before it
    assert [r["step"] for r in resumed] == list(range(ckpt_step + 1, STEPS + 1)), resumed
    assert not checkpointed & {r["batch_id"] for r in resumed}
    assert any(r.get("event") == "done" and r.get("life") == start["life"] for r in after)
    dataflow = [r for r in after if r.get("component") == "dataflow" and "counters" in r]
    reemitted = dataflow[-1]["counters"].get("tasks.reemitted_lost", 0)
    print(f"checkpoint step {ckpt_step}; resumed run finished in {wall:.0f} s; re-emitted {reemitted} lost tasks")
    dataflow_log = (second.run_dir / "logs" / "dataflow.log").read_text()
    assert "the log lost records since the checkpoint" in dataflow_log
