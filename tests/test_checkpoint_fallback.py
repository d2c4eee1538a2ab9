"""A corrupt checkpoint found while a run is live: the trainer refuses it by checksum at restore, says so
(an error line, a typed record) and falls back to the previous kept checkpoint, training the batches
since it again from the log; on the real broker and bucket, the trainer a separate process."""

from __future__ import annotations

import pytest
from raas_support import TopicReader, recipe_dict, send_batches, start_component, stop, write_files

from astraflow.records.control import TrainerCheckpointRefused, TrainerDone, TrainerStart, TrainerStep

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run_to_done(cfg, args, cfg_path, log_path, metrics: TopicReader, lives_before: int) -> None:
    """Start the trainer and wait for a ``done`` of a life started after ``lives_before`` others."""
    proc = start_component(args, cfg_path, log_path)
    try:
        def done() -> bool:
            starts = [r.life for r in metrics.records if isinstance(r, TrainerStart)]
            return len(starts) > lives_before and any(isinstance(r, TrainerDone) and r.life == starts[-1]
                                                      for r in metrics.records)
        metrics.until(lambda _: done(), 120, "the trainer's done",
                      alive=lambda: proc.poll() is None or done() or pytest.fail(log_path.read_text()[-3000:]))
        assert proc.wait(30) == 0, log_path.read_text()[-3000:]
    finally:
        stop(proc)


def test_a_corrupt_shard_is_refused_and_the_trainer_falls_back_to_the_previous_checkpoint(test_cluster, tmp_path):
    from astraflow.log import Topics
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.checkpoint import CheckpointStore

    cfg = test_cluster
    ids = [f"b{i}" for i in range(6)]
    send_batches(cfg, ids[:4])
    metrics = TopicReader(cfg, Topics(cfg.run).metrics)
    args = ["trainer", "--recipe", str(tmp_path / "recipe.yaml"), "--policy", "policy"]
    trainer = {"checkpoint_every": 2, "anchor_every": 10, "max_publish_lag": 2, "keep_checkpoints": 2}
    try:
        cfg_path, _ = write_files(tmp_path, cfg, recipe_dict(cfg.run, trainer={**trainer, "steps": 4}))
        _run_to_done(cfg, args, cfg_path, tmp_path / "life1.log", metrics, 0)
        checkpoints = CheckpointStore(ObjectStore.from_config(cfg), cfg.run, "policy")
        assert checkpoints.kept_steps() == [2, 4]
        # One byte of a shard of the newest checkpoint changed in the bucket (a valid object, the wrong bytes).
        pointer = checkpoints.store.get_json(checkpoints._key("latest.json"))
        assert pointer["step"] == 4 and pointer["format"] == 3
        shard = pointer["parts"]["shards"][0]["key"]
        data = bytearray(checkpoints.store.get_bytes(shard))
        data[len(data) // 2] ^= 0xFF
        checkpoints.store.put_bytes(shard, bytes(data))

        send_batches(cfg, ids[4:])
        write_files(tmp_path, cfg, recipe_dict(cfg.run, trainer={**trainer, "steps": 6}))
        _run_to_done(cfg, args, cfg_path, tmp_path / "life2.log", metrics, 1)
    finally:
        metrics.read()
        metrics.close()
    records = metrics.records
    life1, life2 = [r for r in records if isinstance(r, TrainerStart)]
    (refused,) = [r for r in records if isinstance(r, TrainerCheckpointRefused)]
    assert (refused.life, refused.refused_step, refused.fallback_step) == (life2.life, 4, 2), refused
    assert shard in refused.error and "sha256" in refused.error, refused.error
    assert life2.step == 2 and life2.origin.startswith("checkpoint step 2 "), life2
    assert "after refusing corrupt checkpoint step 4" in life2.origin, life2
    log = (tmp_path / "life2.log").read_text()
    assert "REFUSED checkpoint step 4" in log and "FALLING BACK to the previous kept checkpoint, step 2" in log
    steps = {life: [(r.step, r.batch_id) for r in records if isinstance(r, TrainerStep) and r.life == life]
             for life in (life1.life, life2.life)}
    assert steps[life1.life] == [(1, "b0"), (2, "b1"), (3, "b2"), (4, "b3")]
    # the batches after the checkpoint it fell back to come again from the log, then the new ones
    assert steps[life2.life] == [(3, "b2"), (4, "b3"), (5, "b4"), (6, "b5")]
    versions = [r.version for r in records if isinstance(r, TrainerStep)]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)  # versions only move forward
