"""Train from the archive: ``astraflow run RECIPE --from-archive RUN`` on the real broker and bucket.

An archive is made the way a run makes it (trajectory records on the log, the real archiver writing
Parquet), then a new run's trainer trains on the batches the recipe's dataflow section serves from it:
no dataflow, no RaaS node. Once fed, a run is never fed again (resume), and a changed configuration
is refused for the same run id."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e_helpers import launcher_env, tiny_recipe
from fakes import make_trajectory

from astraflow.archive import Archiver
from astraflow.archive.feed import feed_archive
from astraflow.config import ConfigError
from astraflow.launcher.cluster import write_cluster_file
from astraflow.log import LogProducer, Topics, ensure_topics
from astraflow.recipe import Recipe
from astraflow.records import Trajectory, trajectory
from astraflow.records.control import WeightAnnouncement, send_control

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GROUPS = 13  # 3 full batches of 4 groups, one group left over


def _traj(prompt: str, i: int, version: int) -> Trajectory:
    return make_trajectory(prompt, "policy", i, n=3, version=version, prompt_ids=[5, 6, 7, 8],
                           response_ids=[20 + i, 21, 22], logprobs=[-1.0] * 3, reward=float(i % 2), task_type="math")


def _archive_a_source_run(cfg, group_size: int) -> set[str]:
    """``GROUPS`` groups of ``group_size`` on the source run's log (one record per group, rewards 0/1 so
    no filter has reason to drop them) and a weight version announced after every 4 groups, as a run at
    its pace would; archived by the real archiver."""
    topics = Topics(cfg.run)
    ensure_topics(cfg, {topics.trajectories: 1, topics.metrics: 1, topics.batches("policy"): 1,
                        topics.weights("policy"): 1, topics.dead_letters: 1})
    episodes = set()
    with LogProducer(cfg, "test-raas") as producer:
        acks = []
        for g in range(GROUPS):
            trajs = [_traj(f"q{g}", i, g // 4) for i in range(group_size)]
            episodes |= {t.episode_id for t in trajs}
            acks.append(producer.send_table(topics.trajectories, f"q{g}", trajectory.to_table(trajs),
                                            trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION))
            if g % 4 == 3:
                version = g // 4 + 1
                # Replay orders the two topics by record timestamp (ms); at one millisecond the order
                # across topics is undefined, and a group could land after the next announcement
                # (stale). A run's announcements are milliseconds apart from its trajectories.
                time.sleep(0.003)
                acks.append(send_control(producer, topics.weights("policy"), str(version), WeightAnnouncement(
                    version=version, kind="delta", policy="policy", bytes=0, checksum="test",
                    manifest=f"weights/policy/v{version}/manifest.json"), policy="policy"))
                time.sleep(0.003)
        for ack in acks:
            ack.result(timeout=30)
    archiver = Archiver(cfg, ["policy"])
    try:
        stats = archiver.run(threading.Event(), idle_exit_s=3.0)
    finally:
        archiver.close()
    assert stats.rows["trajectories"] == len(episodes)
    return episodes


def _read_batches(cfg, policy: str, n: int) -> list:
    """The first ``n`` batch records of ``policy``'s topic, read with a group of its own."""
    from astraflow.log import LogConsumer
    from astraflow.records import batch

    consumer = LogConsumer(cfg, Topics(cfg.run).batches(policy), f"test-reader-{cfg.run}",
                           {batch.SCHEMA_NAME: batch.SCHEMA_VERSION})
    out: list = []
    try:
        deadline = time.monotonic() + 30
        while len(out) < n and time.monotonic() < deadline:
            out += [batch.from_table(m.table) for m in consumer.poll(timeout_s=0.5, max_records=50)]
    finally:
        consumer.close()
    return out


def test_a_run_trains_from_another_runs_archive(tmp_path: Path, test_cluster) -> None:
    source = test_cluster
    recipe_path = tiny_recipe(tmp_path, steps=5)
    recipe = Recipe.load(recipe_path)
    episodes = _archive_a_source_run(source, recipe.dataset.samples)
    new_run = f"{source.run}-fed"
    cluster_file = write_cluster_file(source, tmp_path / "cluster.yaml")
    cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(recipe_path), "--from-archive", source.run,
           "--run-id", new_run, "--runs-dir", str(tmp_path / "runs"), "--no-live", "--timeout", "90",
           "--grace", "5", "--no-archive"]
    proc = subprocess.run(cmd, check=False, env=launcher_env(cluster_file), capture_output=True, text=True, timeout=130,
                          cwd=tmp_path)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trainer steps capped at 3" in out, out[-2000:]  # 13 groups of 4 per batch: 3 batches
    run_dir = tmp_path / "runs" / new_run
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["trainer-policy.log"]  # no dataflow, no node
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("component") == "trainer" and not r.get("event") and "step" in r]
    assert [r["batch_id"] for r in steps] == [f"policy-{i:08d}" for i in range(3)]
    assert all(r["trajectories"] == 4 * recipe.dataset.samples for r in steps)
    assert any(r.get("event") == "done" and r["step"] == 3 for r in records)

    # What went to the trainer is the archive's trajectories, each once.
    new_cfg = source.model_copy(update={"run": new_run})
    trained = [t.episode_id for b in _read_batches(new_cfg, "policy", 3) for t in b.trajectories]
    assert len(trained) == len(set(trained)) == 3 * 4 * recipe.dataset.samples
    assert set(trained) <= episodes

    # Fed once per run: a resumed run finds the marker and produces nothing ...
    again = feed_archive(new_cfg, recipe, source.run)
    assert not again.produced and again.batches == {"policy": 3}
    assert again.counters["trajectories.kept"] == len(episodes)  # none stale, none filtered
    # ... and a changed dataflow section is refused for this run id.
    other = recipe.model_copy(update={"dataflow": recipe.dataflow.model_copy(update={"groups_per_batch": 2})})
    with pytest.raises(ConfigError, match="another dataflow configuration"):
        feed_archive(new_cfg, other, source.run)
    with pytest.raises(ConfigError, match="no archive for run"):
        feed_archive(new_cfg.model_copy(update={"run": f"{new_run}-2"}), recipe, f"{source.run}-none")
