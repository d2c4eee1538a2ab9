"""Train from the archive: the batches a dataflow configuration serves from an archived run, produced to
a new run's batch topics, where that run's trainers take them (``astraflow run RECIPE --from-archive RUN``).

The batches come from the same replay as ``astraflow replay`` (:class:`astraflow.archive.replay.ServedBatches`):
the recipe's ``dataflow`` section decides over the archived trajectories and weight timeline exactly as
the online dataflow would, so a data algorithm's effect on training is measured without rollouts. The
new run starts no dataflow and no RaaS node; its trainers are the usual ones (their checkpoints,
restarts and resume included).

Training is off-policy: the archived tokens were sampled by the source run's weights, and the loss's
importance ratio uses the archived behaviour log-probs (``Trajectory.logprobs``) against the new
trainer's own proximal log-probs, clipped as online.

Exactly once per new run: after every batch is acknowledged the feed writes ``<new run>/dataflow/
archive-feed.json`` (source run, configuration, batches per policy). A resumed run finds it and
produces nothing; a feed that died before writing it is produced again from the start, and the trainer
skips the batches it already trained by id (the ids are the replay's, the same every time).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.recipe import Recipe

FEED_OBJECT = "archive-feed.json"
ACK_TIMEOUT_S = 120.0


@dataclass
class FeedResult:
    source: str
    """The archived run the batches came from."""
    batches: dict[str, int]
    """Per policy of the recipe: batches on the new run's topic."""
    produced: bool
    """False when an earlier life of the run had fed them already (the marker object was there)."""
    counters: dict[str, int]
    """The replayed dataflow's counters (kept / dropped by reason), as ``astraflow replay`` reports them."""


def fingerprint(recipe: Recipe, source: str) -> str:
    """What decides the batches: the source run, the dataflow section, the group size and policies."""
    spec = {"source": source, "dataflow": recipe.dataflow.model_dump(mode="json"),
            "group_size": recipe.dataset.samples, "policies": sorted(p.name for p in recipe.policies)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def feed_archive(cfg: ClusterConfig, recipe: Recipe, source: str) -> FeedResult:
    """Produce the batches ``recipe.dataflow`` serves from ``source``'s archive to ``cfg.run``'s batch
    topics (once per new run; see the module docstring)."""
    from astraflow.archive.replay import ArchivedRun, require_archive
    from astraflow.config import ConfigError
    from astraflow.objstore import ObjectStore, RunLayout

    if source == cfg.run:
        raise ConfigError(f"--from-archive {source}: the new run needs its own id (got the source's)")
    store = ObjectStore.from_config(cfg)
    require_archive(store, cfg, source)
    marker_key = RunLayout(cfg.run).dataflow_key(FEED_OBJECT)
    print_ = fingerprint(recipe, source)
    if store.exists(marker_key):
        marker = store.get_json(marker_key)
        if marker.get("fingerprint") != print_:
            raise ConfigError(
                f"run {cfg.run} was fed from the archive of {marker.get('source')!r} with another dataflow "
                f"configuration or policies ({marker_key}); start a new run id for this one")
        return FeedResult(source, dict(marker["batches"]), False, dict(marker.get("counters", {})))
    archived = ArchivedRun(store, source)
    archived.until = archived.dataflow_consumed()
    batches, counters = _produce(cfg, recipe, archived)
    store.put_json(marker_key, {"source": source, "fingerprint": print_, "batches": batches,
                                "counters": counters, "replayed_until": archived.until})
    return FeedResult(source, batches, True, counters)


def _produce(cfg: ClusterConfig, recipe: Recipe, archived: Any) -> tuple[dict[str, int], dict[str, int]]:
    from astraflow.archive.replay import ServedBatches
    from astraflow.log import LogProducer, Topics
    from astraflow.records import batch as batch_rec

    topics = Topics(cfg.run)
    policies = {p.name for p in recipe.policies}
    counts = dict.fromkeys(sorted(policies), 0)
    acks = []
    with LogProducer(cfg, f"{cfg.run}.archive-feed") as producer:
        replayed = ServedBatches(recipe.dataflow, archived.events(), recipe.dataset.samples)
        for b in replayed:
            if b.policy not in policies:
                continue  # a policy of the source run this recipe does not train
            acks.append(producer.send_table(topics.batches(b.policy), b.batch_id, batch_rec.to_table(b),
                                            batch_rec.SCHEMA_NAME, batch_rec.SCHEMA_VERSION, policy=b.policy))
            counts[b.policy] += 1
        producer.flush(ACK_TIMEOUT_S)
        for ack in acks:
            ack.result(timeout=ACK_TIMEOUT_S)  # a refused batch raises: no marker, the next life feeds again
    return counts, replayed.counters
