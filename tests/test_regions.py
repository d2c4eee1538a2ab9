"""Regions: a node reads weights and claims from a regional replica of the bucket (real SeaweedFS
servers, replication by ``weed filer.sync``), sharing the Kafka cluster.

Two SeaweedFS servers of the module's own (origin and replica, each with its Prometheus counters)
and the session's broker. Replication is paused by stopping ``filer.sync`` and resumed by starting
it again (it resumes from the position it saved in the replica filer).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import pytest
import torch
from raas_support import TopicReader, make_recipe, send_tasks
from region_helpers import BucketReplica, sent_bytes
from waiting import wait_until

from astraflow.config import ClusterConfig, RegionSettings, S3Settings

pytestmark = pytest.mark.integration

POLICY = "policy"


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    """(origin server, replica) with replication running."""
    from astraflow.embedded.replica import SeaweedServer

    root = tmp_path_factory.mktemp("regions")
    access, secret = "AF" + secrets.token_hex(6).upper(), secrets.token_urlsafe(20)
    origin = SeaweedServer(root / "origin", access, secret, name="seaweedfs-origin")
    origin.start()
    replica = BucketReplica(root, origin.filer, access, secret)
    try:
        replica.start()
        yield origin, replica
    finally:  # each server takes ~2 s to stop: both at once
        replica.pause()
        stoppers = [threading.Thread(target=server.stop) for server in (replica.server, origin)]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()


def _configs(test_cluster: ClusterConfig, origin, replica, **region) -> tuple[ClusterConfig, ClusterConfig]:
    """(the origin's cluster config, a region-b node's): the same Kafka, the module's origin bucket."""
    s3 = S3Settings(endpoint=origin.endpoint, access_key=origin.access_key, secret_key=origin.secret_key)
    cfg = test_cluster.model_copy(update={"s3": s3})
    settings = RegionSettings(name="b", s3_endpoint=replica.endpoint, backoff_max_s=0.5, **region)
    return cfg, cfg.model_copy(update={"region": settings})


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"simulated.weight": torch.randn(1 << 19, generator=g).to(torch.bfloat16)}


def _step(state: dict[str, torch.Tensor], seed: int) -> None:
    """An RL-like update: 1% of the entries change."""
    g = torch.Generator().manual_seed(seed)
    w = state["simulated.weight"]
    idx = torch.randperm(w.numel(), generator=g)[: w.numel() // 100]
    w[idx] = (w[idx].float() + 0.01 * torch.randn(len(idx), generator=g)).to(torch.bfloat16)


def _bit_exact(served: dict, state: dict) -> bool:
    return set(served) == set(state) and all(
        torch.equal(served[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


# -- unit: the config section --------------------------------------------------------------------
def test_region_section_from_yaml_and_environment(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("region: {name: eu, s3_endpoint: 'http://replica:8333', on_missing: origin}\n")
    cfg = ClusterConfig.load(path, env={"ASTRAFLOW_REGION_MAX_WAIT_S": "5"})
    assert cfg.region is not None and cfg.region.name == "eu" and cfg.region.on_missing == "origin"
    assert cfg.region.max_wait_s == 5.0 and ClusterConfig.load(env={}).region is None
    path.write_text("region: {name: eu, s3_endpoint: 'http://replica:8333', on_missing: never}\n")
    with pytest.raises(ValueError, match="on_missing"):
        ClusterConfig.load(path, env={})


# -- integration ---------------------------------------------------------------------------------
def test_node_serves_from_the_replica_and_waits_out_paused_replication(test_cluster, regions, caplog):
    """A node configured with the regional endpoint serves bit-exactly from the replica (the replica
    server's own byte counter covers what the node read; the origin served none of it); an
    announcement that arrives while replication is paused is waited out (``on_missing: wait``) and
    served once replication resumes; the lag it saw is on the metrics topic and in the log."""
    from astraflow.delta.publisher import WeightPublisher
    from astraflow.log import Topics
    from astraflow.raas import RaasNode

    origin, replica = regions
    cfg, node_cfg = _configs(test_cluster, origin, replica, on_missing="wait", max_wait_s=60)
    caplog.set_level(logging.INFO, logger="astraflow.objstore.regional")
    recipe = make_recipe(cfg.run, pools=[{"name": "default", "concurrency": 2, "engine": {
        "type": "simulated", "tokens_per_s": 2000, "median_tokens": 4, "max_tokens": 8}}])
    state = _weights()
    pub = WeightPublisher(cfg, POLICY, anchor_every=10)
    pub.publish(state, 0)
    pub.flush()
    origin_sent, replica_sent = sent_bytes(origin), sent_bytes(replica.server)
    stop_event = threading.Event()
    node = RaasNode.from_config(node_cfg, recipe, "default", "node-b", stop_event, metrics_every_s=0.5)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    trajectories = TopicReader(cfg, Topics(cfg.run).trajectories)
    metrics = TopicReader(cfg, Topics(cfg.run).metrics)
    try:
        tasks = send_tasks(cfg, 2, "first")
        trajectories.until(lambda items: {t.task_id for t in items} >= set(tasks), 60, "the node's trajectories",
                           alive=lambda: thread.is_alive() or pytest.fail("node died"))
        engine = node.engines[POLICY]
        assert _bit_exact(engine.state_dict(), state)
        _step(state, 1)
        pub.publish(state, 1)
        pub.flush()
        wait_until(lambda: engine.weight_version == 1, 30, "v1 through running replication")
        assert _bit_exact(engine.state_dict(), state)

        replica.pause()
        _step(state, 2)
        pub.publish(state, 2)  # announced on the shared log; its objects stay on the origin
        pub.flush()
        stats = node.follower.objects.stats
        wait_until(lambda: stats.misses >= 1, 30, "the node to look for v2 in the replica")
        time.sleep(1.5)  # deliberate: time for a wrong refresh to show; v2 must stay unserved meanwhile
        assert engine.weight_version == 1, "v2 was served although the replica could not have it"
        replica.resume()
        wait_until(lambda: engine.weight_version == 2, 30, "v2 after replication resumed")
        assert _bit_exact(engine.state_dict(), state)

        assert stats.origin_bytes == 0 and stats.fallbacks == 0 and stats.timeouts == 0
        assert stats.lag_max_s >= 1.5
        assert stats.replica_bytes > 0
        assert sent_bytes(replica.server) - replica_sent >= stats.replica_bytes
        assert sent_bytes(origin) == origin_sent  # the origin served listings, not one object byte

        def lag_reported(items):
            return any(r.get("node_id") == "node-b" and ((r.get("region") or {}).get("lag_s") or 0) >= 1.5
                       for r in items if isinstance(r, dict))
        metrics.until(lag_reported, 30, "a metrics record with the replication lag")
    finally:
        stop_event.set()
        thread.join(60)
        replica.resume()
        trajectories.close()
        metrics.close()
        pub.close()
    assert not thread.is_alive()
    region = [r["region"] for r in metrics.items if isinstance(r, dict) and r.get("region")][-1]
    assert region["region"] == "b" and region["misses"] >= 1
    assert any("replica caught up on" in m and "/weights/policy/v00000002/" in m for m in caplog.messages)


def test_origin_fallback_and_claims_while_replication_is_paused(test_cluster, regions):
    """``on_missing: origin`` reads what the replica lacks from the origin (bit-exact, counted as
    origin bytes, seen by the origin server's own counter); claims follow the same rules; an object
    neither bucket has is not found at once; a bounded wait that runs out fails as unavailable."""
    from astraflow.delta import WeightStore, WeightSubscriber
    from astraflow.delta.publisher import WeightPublisher
    from astraflow.log.claim_check import ClaimCheck
    from astraflow.log.errors import ClaimCheckError
    from astraflow.objstore.regional import RegionalStore, ReplicaLagError, open_reader

    origin, replica = regions
    cfg, fallback_cfg = _configs(test_cluster, origin, replica, on_missing="origin")
    _, wait_cfg = _configs(test_cluster, origin, replica, on_missing="wait", max_wait_s=0.5)
    replica.pause()
    try:
        state = _weights(7)
        with WeightPublisher(cfg, POLICY, anchor_every=10, announce=False) as pub:
            pub.publish(state, 0)
            pub.flush()
        payload = secrets.token_bytes(50_000)
        key, digest = ClaimCheck(cfg).put(payload)
        origin_sent = sent_bytes(origin)

        reader = open_reader(fallback_cfg)
        assert isinstance(reader, RegionalStore)
        sub = WeightSubscriber(fallback_cfg, POLICY, "sub-b", store=WeightStore(reader, cfg.run, POLICY))
        served, version, _ = sub.pull()
        assert version == 0 and _bit_exact(served, state)
        assert reader.stats.fallbacks >= 2 and reader.stats.replica_bytes == 0  # manifest + anchor
        assert sent_bytes(origin) - origin_sent >= reader.stats.origin_bytes > 0
        assert ClaimCheck(fallback_cfg).get(key, digest, len(payload)) == payload

        t0 = time.monotonic()
        with pytest.raises(ReplicaLagError, match="not in the replica"):
            ClaimCheck(wait_cfg).get(key, digest, len(payload))
        with pytest.raises(ClaimCheckError, match="not in bucket"):  # on neither: no wait at all
            ClaimCheck(wait_cfg).get(f"{cfg.run}/claims/{'0' * 64}", "0" * 64)
        assert time.monotonic() - t0 < 10
    finally:
        replica.resume()
    waiting = ClaimCheck(wait_cfg.model_copy(update={"region": wait_cfg.region.model_copy(update={"max_wait_s": 30})}))
    assert waiting.get(key, digest, len(payload)) == payload  # replicated once resumed
