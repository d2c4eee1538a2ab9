"""The archiver on the real broker and bucket: every record archived once, Parquet footers, and
exactly-once across a crash between upload and commit (the Kafka Connect S3 sink's way)."""

from __future__ import annotations

import threading
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes import make_trajectory

from astraflow.archive import Archiver
from astraflow.archive import rows as R
from astraflow.log import LogProducer, Topics, ensure_topics
from astraflow.objstore import ObjectStore, RunLayout
from astraflow.records import Batch, Trajectory, batch, trajectory
from astraflow.records.control import WeightAnnouncement, send_control

pytestmark = pytest.mark.integration
POLICIES = ["solver", "verifier"]


def make_traj(prompt_id: str, policy: str, i: int, n: int = 6) -> Trajectory:
    return make_trajectory(prompt_id, policy, i, n=n, reward=float(i), rewards={"correct": 1.0}, turn_bounds=[0],
                           node_id="node-a", created_at=1.7e9, gen_seconds=0.1, task_type="arith")


def _produce(cfg, prompts: range) -> set[str]:
    """One trajectories record per prompt (2 samples of each policy), a batch per 4 prompts, weights, metrics."""
    topics = Topics(cfg.run)
    prod = LogProducer(cfg, "test-raas")
    episodes: set[str] = set()
    futs = []
    for k in prompts:
        trajs = [make_traj(f"p{k}", p, i) for p in POLICIES for i in range(2)]
        episodes |= {t.episode_id for t in trajs}
        futs.append(prod.send_table(topics.trajectories, f"p{k}", trajectory.to_table(trajs),
                                    trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION))
        if k % 4 == 3:
            b = Batch(batch_id=f"b{k}", policy="solver", trainer_version=k // 4,
                      trajectories=[make_traj(f"p{j}", "solver", i) for j in range(k - 3, k + 1) for i in range(2)])
            futs.append(prod.send_table(topics.batches("solver"), b.batch_id, batch.to_table(b),
                                        batch.SCHEMA_NAME, batch.SCHEMA_VERSION, policy="solver"))
            version = k // 4 + 1
            futs.append(send_control(prod, topics.weights("solver"), str(version), WeightAnnouncement(
                version=version, kind="delta", policy="solver", manifest=f"weights/solver/v{version}/manifest.json",
                bytes=0, checksum="test"), policy="solver"))
        futs.append(prod.send_json(topics.metrics, "node-a", {"component": "raas", "time": 1.0 * k}))
    for f in futs:
        f.result(timeout=30)
    prod.close()
    return episodes


def _topics(cfg) -> None:
    t = Topics(cfg.run)
    spec = {t.trajectories: 1, t.metrics: 1, t.dead_letters: 1}
    for p in POLICIES:
        spec[t.batches(p)] = spec[t.weights(p)] = 1
    ensure_topics(cfg, spec)


def _read(store: ObjectStore, prefix: str) -> tuple[pa.Table, list[str]]:
    keys = sorted(store.list(prefix))
    tables = [pq.read_table(pa.BufferReader(store.get_bytes(k))) for k in keys]
    return (pa.concat_tables(tables) if tables else None), keys


def test_archiver_writes_every_kind_once(test_cluster) -> None:
    cfg = test_cluster
    _topics(cfg)
    episodes = _produce(cfg, range(8))
    store = ObjectStore.from_config(cfg)
    archiver = Archiver(cfg, POLICIES, store=store, max_records=3)
    try:
        stats = archiver.run(threading.Event(), idle_exit_s=4.0)
    finally:
        archiver.close()
    lay = RunLayout(cfg.run)
    trajs, keys = _read(store, lay.archive_prefix("trajectories"))
    assert trajs.num_rows == len(episodes) == 32
    assert set(trajs.column("episode_id").to_pylist()) == episodes
    assert {k.split("/")[3] for k in keys} == {"policy=solver", "policy=verifier"}
    meta = R.parquet_meta(store.get_bytes(keys[0]))
    assert meta[R.META_SCHEMA] == trajectory.SCHEMA_NAME and meta[R.META_SCHEMA_VERSION] == "1"
    assert int(meta[R.META_FIRST]) == 0 and meta[R.META_TOPIC] == Topics(cfg.run).trajectories
    batches, _ = _read(store, lay.archive_prefix("batches"))
    assert batches.num_rows == 16 and set(batches.column("batch_id").to_pylist()) == {"b3", "b7"}
    assert set(batches.column("episode_id").to_pylist()) <= episodes
    weights, _ = _read(store, lay.archive_prefix("weights"))
    assert sorted(weights.column("version").to_pylist()) == [1, 2]
    metrics, mkeys = _read(store, lay.archive_prefix("metrics"))
    assert metrics.num_rows == 8 and all("/policy=" not in k for k in mkeys)
    assert stats.rows["trajectories"] == 32


class _Crash(Exception):
    pass


def test_archiver_crash_between_upload_and_commit_rewrites_same_objects(test_cluster, caplog) -> None:
    cfg = test_cluster
    _topics(cfg)
    episodes = _produce(cfg, range(10))
    store = ObjectStore.from_config(cfg)
    lay = RunLayout(cfg.run)

    class Crashing(Archiver):
        flushes = 0
        crashed: ClassVar[list[str]] = []

        def before_commit(self, uploaded: list[str]) -> None:
            if any("kind=trajectories" in k for k in uploaded):
                Crashing.flushes += 1
                if Crashing.flushes == 2:  # uploaded, not committed: the process dies here
                    Crashing.crashed[:] = uploaded
                    raise _Crash

    first = Crashing(cfg, POLICIES, store=store, max_records=4, group_id=f"{cfg.run}.archive")
    with pytest.raises(_Crash):
        first.run(threading.Event(), idle_exit_s=4.0)
    first.consumer._consumer.close(autocommit=False)  # no clean leave: like a killed process
    before = sorted(store.list(lay.archive_prefix()))
    assert before
    # The restarted archiver flushes at different sizes: the part after the commit must still be
    # rewritten with the same name and rows.
    caplog.set_level("INFO", logger="astraflow.archive.archiver")
    second = Archiver(cfg, POLICIES, store=store, max_records=7, group_id=f"{cfg.run}.archive")
    try:
        second.run(threading.Event(), idle_exit_s=4.0)
    finally:
        second.close()
    after = sorted(store.list(lay.archive_prefix()))
    assert set(before) <= set(after)
    assert "-00000000000000000004.parquet" in Crashing.crashed[0]  # the second part of 4 records
    assert "rewriting it" in caplog.text
    trajs, _ = _read(store, lay.archive_prefix("trajectories"))
    ids = trajs.column("episode_id").to_pylist()
    assert len(ids) == len(set(ids)) == len(episodes) == 40
    offsets = trajs.column("log_offset").to_pylist()
    assert sorted(set(offsets)) == list(range(10))
    metrics, _ = _read(store, lay.archive_prefix("metrics"))
    assert sorted(metrics.column("log_offset").to_pylist()) == list(range(10))
