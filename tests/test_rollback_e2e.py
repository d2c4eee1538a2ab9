"""End to end: ``astraflow run --run-id R --from-checkpoint STEP`` restarts a finished run from an older kept
checkpoint, on an embedded stack with the durable log trimmed every second with no minimum age and no
archiver (so only the positions readers hold keep records): the trainer resumes from that checkpoint,
trains the very batches it trained after it again (the log kept them for its rollback position),
announces a version above every one published, and finishes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from e2e_helpers import LauncherProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 8
KEEP = 4
BACK_TO = STEPS - KEEP + 1
"""The oldest checkpoint a run of ``STEPS`` steps keeps (one per step)."""


def _env(tmp_path: Path) -> dict[str, str]:
    """No cluster running: the launcher starts (and stops) an embedded stack in the state dir, whose log
    (``--log-storage s3``) and bucket outlive it; the log trimmed every second, below the readers' positions."""
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"),
                                      "kafka": {"retention": {"keep_s": 0, "interval_s": 1}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env["ASTRAFLOW_CONFIG"] = str(config)
    return env


def _launch(tmp_path: Path, *args: str) -> LauncherProcess:
    return LauncherProcess(tmp_path, "rollback", _env(tmp_path), STEPS, timeout_s=150,
                           extra_args=("--log-storage", "s3", "--no-archive", *args),
                           trainer={"keep_checkpoints": KEEP})


def test_a_finished_run_restarts_from_an_older_checkpoint_and_trains_its_batches_again(tmp_path: Path) -> None:
    first = _launch(tmp_path)
    assert first.wait(180) == 0, first.output[-3000:]
    before = first.records()
    dataflow_log = (first.run_dir / "logs" / "dataflow.log").read_text()
    retention = json.loads(next(line for line in reversed(dataflow_log.splitlines())
                                if line.startswith("{")))["log_retention"]
    trained = {r["step"]: (r["batch_id"], r["version"]) for r in before
               if r.get("component") == "trainer" and "batch_id" in r and not r.get("event")}
    assert sorted(trained) == list(range(1, STEPS + 1)), trained

    second = _launch(tmp_path, "--from-checkpoint", str(BACK_TO))
    assert second.wait(180) == 0, second.output[-3000:]
    assert f"policy: rolled back to checkpoint step {BACK_TO}" in second.output, second.output[-3000:]
    after = second.records()[len(before):]
    start = next(r for r in after if r.get("component") == "trainer" and r.get("event") == "start")
    assert start["step"] == BACK_TO and start["origin"].startswith(f"checkpoint step {BACK_TO} "), start
    # the checkpoint's weights under a version above every one the rolled-back steps published
    assert start["version"] > max(v for _, v in trained.values()), (start, trained)
    again = [r for r in after if r.get("life") == start["life"] and "batch_id" in r and not r.get("event")]
    assert [r["step"] for r in again] == list(range(BACK_TO + 1, STEPS + 1)), again
    # the very batches the first life trained after the checkpoint, read again from the trimmed log
    assert [r["batch_id"] for r in again] == [trained[s][0] for s in range(BACK_TO + 1, STEPS + 1)]
    assert any(r.get("event") == "done" and r.get("life") == start["life"] for r in after)
    # The log was trimmed while the first run ran, batches included: the rollback position kept these.
    assert retention["errors"] == 0 and retention["records"] > 0, retention
    print(f"log retention of the first run: {retention}")
