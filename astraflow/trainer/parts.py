"""What a trainer works with (:class:`TrainerParts`), built by :func:`build_trainer_parts` once its
rank group has started; :class:`~astraflow.trainer.service.TrainerService` is handed them."""

from __future__ import annotations

import functools
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astraflow.log.until_acked import UntilAcked
from astraflow.trainer.checkpoint import CheckpointStore, TrainerCheckpoint
from astraflow.trainer.checkpoint_writer import CheckpointWriter

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.delta import WeightPublisher, WeightSubscriber
    from astraflow.log import LogProducer
    from astraflow.log.positions import HeldPosition
    from astraflow.recipe import Recipe
    from astraflow.trainer.base import TrainerBackend
    from astraflow.trainer.distributed import RankGroup

log = logging.getLogger(__name__)

__all__ = ["TrainerParts", "build_trainer_parts"]


@dataclass
class TrainerParts:
    """A trainer's identity and collaborators. Rank 0 alone reads and writes the log and reads the weight
    store, so the leader-only parts (subscriber, producer, records) are None on the others; the publisher
    is rank 0's, or every rank's when each publishes its own rows (:attr:`publishes_rows`)."""

    life: str
    """Identifies this life of the trainer (the same on every rank of its group)."""
    topic_ids: dict[str, str | None]
    """Ids of the topics this trainer reads, as of its start (saved with each checkpoint; rank 0)."""
    checkpoints: CheckpointStore
    """This policy's checkpoints in the bucket."""
    checkpoint_writer: CheckpointWriter[list[Any]]
    """Saves checkpoints off the training loop; covers the batch records they make safe to commit."""
    backend: TrainerBackend
    """Trains the model."""
    subscriber: WeightSubscriber | None = None
    """Reads the weight store at the bootstrap (leader)."""
    producer: LogProducer | None = None
    """Sends the trainer's records (leader)."""
    records: UntilAcked | None = None
    """The step, start, skipped and done records through ``producer``: each is the only one of its
    kind, so a refused one is sent again (leader)."""
    publisher: WeightPublisher | None = None
    """Publishes weight versions off the training loop (leader; every rank with :attr:`publishes_rows`)."""
    publishes_rows: bool = False
    """Each rank publishes its own rows of every version (its part, no gather); rank 0 writes the
    manifest (:mod:`astraflow.delta.parts`). Otherwise rank 0 publishes the gathered weights whole."""
    rollback_position: HeldPosition | None = None
    """Holds the batches back to the oldest kept checkpoint in the log, committed after each save (leader)."""


def build_trainer_parts(cfg: ClusterConfig, recipe: Recipe, policy: str, group: RankGroup) -> TrainerParts:
    """The parts of ``policy``'s trainer; ``group`` has started. Collective on a rank group: the life
    id is rank 0's. On rank 0 the trainer's topics exist (and their ids are known) when it returns."""
    from astraflow.log import ConsumerGroups, Topics, ensure_topics
    from astraflow.log.identity import topic_ids
    from astraflow.log.positions import HeldPosition
    from astraflow.models import load_policy_model
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.backend import build_backend

    spec, tspec = recipe.policy(policy), recipe.trainer
    # one life per group: it names the group's records and its checkpoint saves
    life = group.broadcast_json(uuid.uuid4().hex[:8])
    topics = Topics(cfg.run)
    ids: dict[str, str | None] = {}
    if group.leader:
        ensure_topics(cfg, {topics.batches(policy): 1, topics.weights(policy): 1, topics.metrics: 1})
        ids = topic_ids(cfg, [topics.batches(policy)])
    checkpoints = CheckpointStore(ObjectStore.from_config(cfg), cfg.run, policy,
                                  keep_checkpoints=tspec.keep_checkpoints)
    rollback = HeldPosition(cfg, ConsumerGroups(cfg.run).trainer_rollback(policy)) if group.leader else None
    writer: CheckpointWriter[list[Any]] = CheckpointWriter(
        functools.partial(_save_checkpoint, cfg, policy, checkpoints, rollback), f"checkpoint-{policy}")
    backend = build_backend(load_policy_model(recipe, policy), spec.backend)
    if group.distributed and not backend.runs_as_rank_group:
        raise RuntimeError(f"trainer {policy}: backend {spec.backend.type!r} does not run as a group of "
                           f"ranks (trainer.ranks = {group.world_size}); run it with trainer.ranks: 1")
    parts = TrainerParts(life=life, topic_ids=ids, checkpoints=checkpoints, checkpoint_writer=writer,
                         backend=backend, rollback_position=rollback)
    # the same answer on every rank: a rank group whose backend gives each rank its rows
    parts.publishes_rows = group.distributed and backend.publishes_rows
    if group.leader:
        _open_leader_parts(parts, cfg, recipe, policy, group)
    elif parts.publishes_rows:
        parts.publisher = _publisher(cfg, recipe, policy, parts, group, f"{cfg.run}.trainer.{policy}.{life}")
    return parts


def _open_leader_parts(parts: TrainerParts, cfg: ClusterConfig, recipe: Recipe, policy: str,
                       group: RankGroup) -> None:
    """Rank 0's clients of the weight store and the log, named after the trainer's life."""
    from astraflow.delta import WeightSubscriber
    from astraflow.log import LogProducer

    producer_id = f"{cfg.run}.trainer.{policy}.{parts.life}"
    parts.subscriber = WeightSubscriber(cfg, policy, f"trainer-{parts.life}", register=False)
    parts.producer = LogProducer(cfg, producer_id)
    parts.records = UntilAcked(parts.producer)
    parts.publisher = _publisher(cfg, recipe, policy, parts, group, producer_id)


def _publisher(cfg: ClusterConfig, recipe: Recipe, policy: str, parts: TrainerParts, group: RankGroup,
               producer_id: str) -> WeightPublisher:
    """The rank's weight publisher: of its part of each version with :attr:`TrainerParts.publishes_rows`
    (rank 0's writes the manifests, announces and runs the GC), else rank 0's of the whole weights."""
    from astraflow.delta import WeightPublisher
    from astraflow.delta.parts import PartOf
    from astraflow.delta.retention import RetentionPolicy

    tspec = recipe.trainer
    # a KL objective's reference is v0, read at every start of the trainer: the in-run GC keeps it
    retention = RetentionPolicy(pinned=(0,)) if parts.backend.wants_reference else None
    part = PartOf(group.rank, group.world_size, parts.life) if parts.publishes_rows else None
    return WeightPublisher(cfg, policy, anchor_every=tspec.anchor_every, max_lag_versions=tspec.max_publish_lag,
                           gc_every=tspec.weights_gc_every, retention=retention, producer_id=f"{producer_id}.weights",
                           part=part)


def _save_checkpoint(cfg: ClusterConfig, policy: str, checkpoints: CheckpointStore,
                     rollback: HeldPosition | None, ckpt: TrainerCheckpoint) -> None:
    """On the writer's thread. A restarting S3 server is waited out (one line per backoff step),
    not a reason to exit: the save writes the same keys again, pointer last. Then (rank 0) the log
    position ``rollback`` moves to the oldest kept checkpoint's offsets: what a rollback to it, or a
    fall back from a corrupt newer one, trains again stays in the log. A failed hold keeps the older
    position (more of the log, never less)."""
    from astraflow.log.offsets import partitions_of
    from astraflow.outage import OutageReport, wait_out_outage

    s3 = OutageReport(f"trainer {policy}: checkpoint, S3 endpoint", str(cfg.s3.endpoint), log)
    pointer = wait_out_outage(lambda: checkpoints.save(ckpt), s3)
    offsets = checkpoints.oldest_kept_offsets() if pointer is not None and rollback is not None else None
    if offsets:
        rollback.hold(partitions_of(offsets))
