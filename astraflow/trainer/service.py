"""The trainer process of one policy: batches in, weight versions out, resumable from the bucket.

Bootstrap (the weight bootstrap rule): resume from this policy's checkpoint in the bucket if there
is one (a corrupt one is refused by name, in an error line and a ``TrainerCheckpointRefused`` record,
and the next older kept checkpoint is tried; :class:`CheckpointError` when none is left); else load
the latest version the weight store has (e.g. v0 published by ``astraflow demo`` after the SFT warm
start); else build the model from the recipe (seeded), run the policy's ``sft`` warm start if the recipe has one (so
``astraflow run RECIPE`` alone starts RL from the same kind of weights as the demo), and publish it
as v0 (an anchor).

Exactly-once training across restarts ("restart does not re-train consumed batches"):
a batch counts as *consumed* once its update is inside a checkpoint. Every
``trainer.checkpoint_every`` steps (and on a clean stop, and at the end) the trainer snapshots model +
optimizer + step/version + the next offset per partition + the ids of the batches trained, writes
the snapshot on a background thread while it trains on (:mod:`astraflow.trainer.checkpoint_writer`),
and only once it is written commits the batch offsets it covers to the consumer group. After a crash
the new life loads the checkpoint and the group hands out exactly the batches after it: every
consumed batch is in the model exactly once, and the batches trained after the last checkpoint (whose
updates died with the process) are trained once more, in the resumed lineage. If the crash hit
between the checkpoint write and the commit, the re-delivered batches are below the checkpointed
offsets or carry a checkpointed batch id, and are skipped.

Versions: each step publishes ``version + 1`` (its weights cast to ``trainer.publish_dtype``,
bf16 by default; checkpoints keep the fp32 masters) off the critical path (``WeightPublisher`` encodes
and uploads on its own thread; the step waits only when more than ``trainer.max_publish_lag``
versions are queued).
A life that resumes from an older checkpoint than its group committed (a rollback with ``astraflow run
--from-checkpoint``, a corrupt newest checkpoint refused) reads its batch topic from that checkpoint's
offsets, not the group's, and trains the batches since it again.
Versions that a crashed life published after its last checkpoint are orphaned: the resumed trainer
publishes its checkpointed weights as a fresh version above anything published, so nodes never
see a version number go backwards, and continues from there.

A group of ranks (``trainer.ranks`` > 1, launched by torch.distributed.run; the contract is
:mod:`astraflow.trainer.distributed`): every rank runs this service, rank 0 alone reads the batch topic,
commits, publishes and writes records, and each loop turn it broadcasts one command (train this
batch / checkpoint / idle / stop) so that all ranks make the same collective calls. Checkpoints of
the torch backend are sharded (torch.distributed.checkpoint, format 3) at any world size and resume
at any other.

Records on ``<run>.metrics`` (key ``trainer.<policy>``), typed control records
(:mod:`astraflow.records.control`, each with its own schema name): a ``TrainerCheckpointRefused`` per
checkpoint refused at the start; a ``TrainerStart`` per life; a
``TrainerStep`` per step once its version is published (``publish_bytes`` known; ``publish_s``: seconds
from the step's end to its version's announcement being acknowledged; the torch backend's
``zero_adv_frac``, ``trained_trajectories``, ``entropy`` and (a KL objective) ``kl_ref``; ``weights_gc_deleted`` and ``checkpoints_deleted``: weight
versions and checkpoints this life deleted so far, per ``trainer.weights_gc_every`` and
``trainer.keep_checkpoints``); a ``TrainerSkipped`` (reason ``duplicate`` | ``invalid``) for a batch record
whose id was trained already (a restarted dataflow re-produced it) or that does not decode (``batch_id``:
its key), which the dataflow reads; and a ``TrainerDone`` after ``trainer.steps`` steps. A checkpoint is
taken only once the step records of the steps it covers are acknowledged: a resumed life never takes
those steps again, so it could not write them again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from astraflow.log.handoff import HandoffLatency
from astraflow.records import batch as batch_rec
from astraflow.records.batch import Batch
from astraflow.records.control import (
    TrainerCheckpointRefused,
    TrainerDone,
    TrainerRecord,
    TrainerSkipped,
    TrainerStart,
    TrainerStep,
    send_control,
)
from astraflow.records.trajectory import TRUNCATED
from astraflow.trainer.checkpoint import CheckpointError, TrainerCheckpoint
from astraflow.trainer.distributed import Command, RankGroup, current_group
from astraflow.trainer.parts import TrainerParts, build_trainer_parts

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.recipe import Recipe

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "publishable", "run_trainer"]

BACKEND_FIGURES = ("zero_adv_frac", "trained_trajectories", "updates_skipped", "clip_frac", "behav_kl", "entropy", "kl_ref")
"""The backend's step figures a :class:`TrainerStep` carries when the backend reports them."""


STEP_RECORDS_WAIT_S = 10.0
"""How long a checkpoint waits for the step records it covers before it says so (and waits on)."""
STEP_RECORDS_STOP_WAIT_S = 30.0
"""On a stop (SIGTERM: a pod's grace period is 30 s by default) the wait gives up after this long."""


def publishable(state: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The weights as published: floating tensors cast to ``dtype`` (``TrainerSpec.publish_dtype``);
    the caller's fp32 masters are untouched."""
    import torch

    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}


def _offset_key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


class TrainerService:
    def __init__(self, cfg: ClusterConfig, recipe: Recipe, policy: str, parts: TrainerParts,
                 stop_event: threading.Event, *, poll_timeout_s: float = 0.5,
                 group: RankGroup | None = None) -> None:
        self.group = current_group() if group is None else group
        """This process's rank in the trainer's group (one rank unless launched by torch.distributed.run)."""
        self.cfg = cfg
        self.recipe = recipe
        self.policy = policy
        self.spec = recipe.policy(policy)
        self.tspec = recipe.trainer
        self.stop_event = stop_event
        self.poll_timeout_s = poll_timeout_s
        self.component_id = f"trainer.{policy}"
        self.life = parts.life
        """Identifies this process in metrics (a restarted trainer has a new one)."""
        self.checkpoints, self.checkpoint_writer, self.backend = (parts.checkpoints, parts.checkpoint_writer,
                                                                  parts.backend)
        # rank 0's alone (None on the other ranks): only rank 0 reads and writes the log and reads the weight
        # store; the publisher is every rank's when each publishes its own rows (``publishes_rows``)
        self.subscriber, self.producer, self.records, self.publisher = (parts.subscriber, parts.producer,
                                                                        parts.records, parts.publisher)
        self.rollback_position = parts.rollback_position
        self.publishes_rows = parts.publishes_rows
        self.step = 0
        self.version = 0
        self.offsets: dict[str, int] = {}
        self.batch_ids: list[str] = []
        self._trained: set[str] = set()
        self.skipped = {"duplicate": 0, "already_checkpointed": 0, "invalid": 0}
        self._uncommitted: list[Any] = []
        self._last_ckpt_step = 0
        self._pending_records: dict[int, tuple[dict[str, Any], float]] = {}
        """Version -> its step's :class:`TrainerStep` fields known at the step's end and the Unix time it
        ended, until the version is published."""
        self._seen_published = 0
        self._read_partitions: set[str] = set()
        """Batch partitions this life has read a record of (the first one is checked against the checkpoint)."""
        self.topic_ids: dict[str, str | None] = parts.topic_ids
        """Ids of the topics this trainer reads, as of its start (saved with each checkpoint)."""
        self.warm_start: dict[str, Any] | None = None
        """SFT figures when this trainer warm-started a fresh model (the ``start`` metrics record)."""

    @classmethod
    def from_config(cls, cfg: ClusterConfig, recipe: Recipe, policy: str, stop_event: threading.Event,
                    group: RankGroup, **options: Any) -> TrainerService:
        """``policy``'s trainer with the parts the recipe names (:func:`build_trainer_parts`); ``group``
        has started. Collective on a rank group."""
        parts = build_trainer_parts(cfg, recipe, policy, group)
        return cls(cfg, recipe, policy, parts, stop_event, group=group, **options)

    # -- bootstrap ---------------------------------------------------------------------------------
    def _bootstrap(self) -> str:
        """Collective on a rank group: every rank loads the same state; rank 0 alone reads and writes
        the weight store (what it finds is broadcast). Returns where the state came from."""
        latest = self.group.broadcast_json(self.subscriber.latest_version() if self.group.leader else None)
        origin = self._resume_from_checkpoints(latest)
        if origin is None:
            origin = self._load_published(latest) if latest is not None else self._start_fresh()
        if self.backend.wants_reference:
            self._load_reference()
        return origin

    def _load_reference(self) -> None:
        """Hand the backend its frozen reference policy (a KL term): version 0 as published, the weights
        the engines sampled the first batches with (after the SFT warm start). Rank 0 reads it from the
        weight store, whose in-run GC keeps it (:mod:`astraflow.trainer.parts`); a run whose v0 was
        deleted all the same (``astraflow weights gc``, an earlier life without a KL objective) cannot
        rebuild it and is refused by name."""
        from astraflow.delta.errors import VersionNotFoundError

        state: dict[str, Any] = {}
        if self.group.leader:
            try:
                state = self.subscriber.store.get_anchor(0)
            except VersionNotFoundError as exc:
                raise RuntimeError(f"trainer {self.policy}: objective.kl needs version 0 (the reference policy) in "
                                   f"the weight store, which no longer has it ({exc}): it was garbage-collected "
                                   "by `astraflow weights gc` or by a trainer without a KL objective (one with "
                                   "it keeps v0); start a fresh run, or keep every version with "
                                   "trainer.weights_gc_every: 0") from exc
        self.backend.set_reference(state)
        log.info("trainer %s: reference policy for the KL term: version 0", self.policy)

    def _resume_from_checkpoints(self, latest: int | None) -> str | None:
        """Resume from the newest checkpoint that passes its checks (:meth:`_resume`); None when there is
        none. One that fails them (a part whose bytes changed in the bucket, a pointer that does not parse)
        is refused by name, loudly (an error line and a :class:`TrainerCheckpointRefused` record), and the
        next older kept checkpoint is tried; the batches trained since that one come again
        (:meth:`_join_batches`), kept in the log by the rollback position (:mod:`astraflow.trainer.parts`).
        Raises :class:`CheckpointError` when no kept checkpoint passes. The same on every rank of a group:
        each reads every object, so each refuses the same ones."""
        step: int | None = None  # None: latest.json
        refusals: list[str] = []
        while True:
            refused: int | None = step
            try:
                ckpt = self.checkpoints.load(step)
                if ckpt is None:
                    if step is None:
                        return None
                    raise CheckpointError(f"trainer checkpoint step {step}: its pointer is gone")
                refused = ckpt.step
                origin = self._resume(ckpt, latest)
            except CheckpointError as exc:
                older = [s for s in self.checkpoints.kept_steps() if refused is None or s < refused]
                step = older[-1] if older else None
                self._refuse(refused, exc, step)
                if step is None:
                    raise
                refusals.append(f"step {refused}" if refused is not None else "latest.json")
                continue
            return origin + (f", after refusing corrupt checkpoint {', '.join(refusals)}" if refusals else "")

    def _refuse(self, refused: int | None, exc: CheckpointError, fallback: int | None) -> None:
        what = f"checkpoint step {refused}" if refused is not None else "the latest checkpoint's pointer"
        then = (f"FALLING BACK to the previous kept checkpoint, step {fallback}; the batches trained since it are "
                f"trained again" if fallback is not None else "no older kept checkpoint is left: stopping")
        log.error("trainer %s: REFUSED %s: %s; %s", self.policy, what, exc, then)
        if self.group.leader:
            self._emit(TrainerCheckpointRefused, step=0, refused_step=refused, error=str(exc), fallback_step=fallback)

    def _resume(self, ckpt: TrainerCheckpoint, latest: int | None) -> str:
        """Continue from checkpoint ``ckpt``; ``latest``: the newest version in the weight store."""
        from astraflow.trainer.sharded_checkpoint import restore

        leader = self.group.leader
        if ckpt.stored_shards is not None:
            restore(self.checkpoints, ckpt, self.backend, self.group)
        else:
            self.backend.load_state(ckpt.model_state if leader else {}, ckpt.optimizer_state if leader else None)
        self.step, self.version = ckpt.step, ckpt.version
        self.offsets, self.batch_ids = dict(ckpt.offsets), list(ckpt.batch_ids)
        if leader:
            self._forget_offsets_of_recreated_topics(ckpt.topic_ids)
        self._trained = set(self.batch_ids)
        self._last_ckpt_step = ckpt.step
        if latest is None or latest != self.version:
            # The lost life published past the checkpoint (or the checkpoint's own version never
            # made it): announce the checkpointed weights under a version nobody has seen.
            self.version = max(self.version, (latest or 0) + 1)
            self._publish_now(self.version, self.batch_ids[-1] if self.batch_ids else None)
        return f"checkpoint step {ckpt.step} (version {self.version})"

    def _load_published(self, latest: int) -> str:
        """No checkpoint: start from version ``latest`` of the weight store (pulled by rank 0)."""
        leader = self.group.leader
        state = self.subscriber.pull(latest)[0] if leader else {}
        self.backend.load_state(state, None)
        self.version = latest
        # The pulled bits are the stored version's: the first step publishes a delta from them.
        if self.publishes_rows:  # each rank's rows of them, as loaded (the cast back to the published dtype is exact)
            rows = self.backend.weight_rows(self._publish_dtype, on_device=self._encode_on_device)
            self.publisher.assume_published(rows.tensors, latest, rows=rows.rows, shapes=rows.shapes)
        elif leader:
            self.publisher.assume_published(state, latest)
        return f"weight store version {latest}"

    def _start_fresh(self) -> str:
        """Neither a checkpoint nor a published version: the seeded model (after the recipe's SFT warm
        start, if any) is published as v0."""
        self.version = 0
        origin = "seeded model"
        if self.spec.sft is not None and self.spec.backend.type != "simulated":
            self.warm_start = self._warm_start()
            origin += (f" + SFT warm start ({self.warm_start['sft_steps']} steps, final loss "
                       f"{self.warm_start['sft_final_loss']:.3f})")
        elif self.group.distributed:
            # every rank starts from rank 0's weights, however each built its model
            full = self.backend.state_dict()
            self.backend.load_state(full, None)
        self._publish_now(0)
        return f"{origin}, published as v0"

    def _forget_offsets_of_recreated_topics(self, saved_ids: dict[str, str | None]) -> None:
        """A batch topic re-created since the checkpoint (the log was lost: an in-memory broker
        restarted) starts again at offset 0: its checkpointed offsets would skip every new batch
        below them. Drop them; re-sent batches are still recognised by their ids."""
        from astraflow.log.identity import recreated_topics

        gone = recreated_topics(saved_ids, self.topic_ids)
        dropped = [k for k in self.offsets if k.rsplit(":", 1)[0] in gone]
        for k in dropped:
            del self.offsets[k]
        if dropped:
            log.warning("trainer %s: topics %s were re-created since checkpoint step %d (the log lost records): "
                        "reading them from their start; batches already trained are skipped by id",
                        self.policy, sorted(gone), self.step)

    def _warm_start(self) -> dict[str, Any] | None:
        """The policy's ``sft`` warm start on the fresh model, as ``astraflow demo`` does it. It runs
        on the HF model: the built-in backend's own, or for another backend (Megatron) or a rank group
        a fresh one on rank 0, whose weights the backend then loads by their HF names (collective).
        Its figures on rank 0, None on the others."""
        import torch

        from astraflow.models import load_policy_model, load_policy_tokenizer
        from astraflow.sft import warm_start
        from astraflow.tasks.base import seeded_dataset

        in_place = self.spec.backend.type == "torch" and not self.group.distributed
        figures = None
        model = None
        if self.group.leader:
            log.info("trainer %s: fresh model, running the recipe's SFT warm start before publishing v0",
                     self.policy)
            torch.manual_seed(self.recipe.seed)
            tokenizer = load_policy_tokenizer(self.recipe, self.policy)
            model = self.backend.model if in_place else load_policy_model(self.recipe, self.policy)
            dataset = seeded_dataset(self.recipe.dataset, self.recipe.seed)  # the recipe's, as recipe_dataset builds it
            figures = warm_start(model, tokenizer, self.recipe, self.policy, dataset=dataset, progress=False)
            log.info("trainer %s: SFT warm start done: %d steps in %.1fs, final loss %.3f", self.policy,
                     figures["sft_steps"], figures["sft_seconds"], figures["sft_final_loss"])
        if not in_place:
            self.backend.load_state(model.state_dict() if model is not None else {}, None)
        return self.group.broadcast_json(figures)

    # -- checkpointing -----------------------------------------------------------------------------
    def _checkpoint_due(self) -> bool:
        """Rank 0: something is not in a checkpoint yet (steps, or skipped records to commit)."""
        return self.step != self._last_ckpt_step or bool(self._uncommitted)

    def _checkpoint(self, consumer: Any, *, wait: bool = False, due: bool | None = None) -> None:
        """Snapshot the state and save it off the loop (:mod:`astraflow.trainer.checkpoint_writer`);
        ``wait``: until it is durable and its batches are committed (a clean stop, the end). ``due``:
        whether to snapshot (default :meth:`_checkpoint_due`; on a rank group rank 0's decision, which
        every rank follows). Collective on a rank group: the backend's sharded state is written by DCP
        to local disk here, each rank uploads its own files on its writer thread, rank 0 writes the
        pointer."""
        if self._checkpoint_due() if due is None else due:
            self._snapshot(consumer)
        self._commit_saved(consumer, wait=wait)

    def _snapshot(self, consumer: Any) -> None:
        from astraflow.trainer.sharded_checkpoint import write_local

        self._commit_saved(consumer, wait=True)  # one save at a time, commits in order
        if self.group.leader:
            self._settle_step_records()
        sharded = self.backend.sharded_state()
        common = {"step": self.step, "version": self.version, "offsets": dict(self.offsets),
                  "batch_ids": list(self.batch_ids), "topic_ids": dict(self.topic_ids)}
        if sharded is not None:
            shards = write_local(sharded, self.group, f"{self.life}-{self.step}")
            ckpt = TrainerCheckpoint(model_state={}, optimizer_state=None, local_shards=shards, **common)
        elif self.group.distributed:
            raise RuntimeError(f"trainer {self.policy}: backend {type(self.backend).__name__} has no sharded state "
                               f"(sharded_state), so it cannot checkpoint as a group of ranks")
        else:
            ckpt = TrainerCheckpoint(model_state=self.backend.state_dict(),
                                     optimizer_state=self.backend.optimizer_state_dict(), **common)
        self.checkpoint_writer.start(ckpt, self._uncommitted)
        self._uncommitted = []
        self._last_ckpt_step = self.step

    def _settle_step_records(self) -> None:
        """Before a checkpoint covers the steps taken so far, their step records are in the log: a life
        that resumes from the checkpoint does not take (or report) those steps again, so a record still
        queued or in flight when this one is killed would be lost for good. Waits for the publisher
        (a step's record is written once its version is announced), then for the acknowledgements;
        a broker that stays away is waited out, said once every ``STEP_RECORDS_WAIT_S``."""
        self.publisher.flush()
        self._emit_published()
        waited = 0.0
        while not self.records.settle(STEP_RECORDS_WAIT_S):
            waited += STEP_RECORDS_WAIT_S
            log.warning("trainer %s: step records not acknowledged after %.0f s; the checkpoint at step %d "
                        "waits for them", self.policy, waited, self.step)
            if self.stop_event.is_set() and waited >= STEP_RECORDS_STOP_WAIT_S:
                log.error("trainer %s: stopping with step records unacknowledged; a resumed run misses them",
                          self.policy)
                return

    def _commit_saved(self, consumer: Any, *, wait: bool = False) -> None:
        """Only once its checkpoint is durable do the batches it covers count as consumed for the group."""
        saved = self.checkpoint_writer.collect(wait=wait)
        if saved is None:
            return
        if saved.covered:
            consumer.commit(saved.covered)
        if not self.group.leader:
            return
        log.info("trainer %s: checkpoint at step %d / v%d saved in %.2fs (off the training loop)", self.policy,
                 saved.checkpoint.step, saved.checkpoint.version, saved.save_s)

    # -- main loop ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Bootstrap, train until ``trainer.steps`` steps or ``stop_event``, and finish; rank 0's parts
        are closed however it ends. Collective on a rank group (whose start and close are the caller's)."""
        consumer = None
        finished = False
        try:
            self._begin()
            if self.group.leader:
                consumer = self._join_batches()
            self._loop(consumer)
            finished = self._finish(consumer)
        finally:
            if self.group.leader:
                self._close(consumer)
            elif self.publisher is not None:
                self.publisher.close()
        return {"step": self.step, "version": self.version, "finished": finished, "skipped": dict(self.skipped),
                "life": self.life, "rank": self.group.rank, "ranks": self.group.world_size}

    def _begin(self) -> None:
        """Bootstrap (:meth:`_bootstrap`) and say where this life starts from."""
        origin = self._bootstrap()
        ranks = f" on {self.group.world_size} ranks" if self.group.distributed else ""
        log.info("trainer %s (life %s%s) starts from %s", self.policy, self.life, ranks, origin)
        if self.group.leader:
            self._emit(TrainerStart, step=self.step, version=self.version, origin=origin,
                       warm_start=self.warm_start or None)

    def _join_batches(self) -> Any:
        """Rank 0's consumer of the batch topic. Created only after the bootstrap: it joins the
        trainer's group once the checkpointed offsets are known."""
        from astraflow.log import ConsumerGroups, LogConsumer, Topics
        from astraflow.log.offsets import partitions_of

        group = ConsumerGroups(self.cfg.run).trainer(self.policy)
        # From the checkpoint's offsets, not the group's: they differ when this life resumes from an older
        # checkpoint than the newest (a rollback, a corrupt newest one refused), whose batches come again.
        return LogConsumer(self.cfg, Topics(self.cfg.run).batches(self.policy), group,
                           {batch_rec.SCHEMA_NAME: batch_rec.SCHEMA_VERSION}, start_at=partitions_of(self.offsets),
                           max_poll_interval_ms=600_000, client_id=f"trainer-{self.policy}-{self.life}")

    def _loop(self, consumer: Any) -> None:
        """One command a turn (:meth:`_turn`), the same on every rank, until the command to stop."""
        wait_from = time.perf_counter()
        while True:
            command, msg, batch = self._turn(consumer)
            if command is Command.STOP:
                return
            if command is Command.CHECKPOINT:
                self._checkpoint(consumer, due=True)
            elif command is Command.TRAIN:
                self._train(msg, batch, time.perf_counter() - wait_from)
                wait_from = time.perf_counter()
            elif not self.group.leader:
                self._commit_saved(consumer)  # a failed upload of this rank's shards surfaces here

    def _finish(self, consumer: Any) -> bool:
        """The last versions' step records, the last checkpoint's commit, and (at the step target) the
        done record. Whether the step target was reached."""
        finished = self.step >= self.tspec.steps
        if self.group.leader:
            self.publisher.flush()
            self._emit_published()
        elif self.publisher is not None:
            self.publisher.flush()
        self._commit_saved(consumer, wait=True)
        if finished and self.group.leader:
            self._emit(TrainerDone, step=self.step, version=self.version, skipped=self.skipped)
        return finished

    def _close(self, consumer: Any) -> None:
        """Rank 0: close the publisher, then the consumer (if it was created), give the records in
        flight a last chance to be acknowledged, and close the producer."""
        try:
            self.publisher.close()
        finally:
            if self.rollback_position is not None:
                self.rollback_position.close()
            if consumer is not None:
                consumer.close()
        if not self.records.settle(10):
            log.warning("trainer %s: some metrics records were not acknowledged before exit", self.policy)
        self.producer.close()

    def _turn(self, consumer: Any) -> tuple[Command, Any, Batch | None]:
        """This loop turn's command, the same on every rank: rank 0 decides it (:meth:`_lead`) and
        broadcasts it with the batch's Arrow bytes; the others decode the batch. Returns the command,
        the batch record (rank 0) and the batch."""
        from astraflow.log.codec import ArrowCodec

        msg = None
        if self.group.leader:
            command, msg, batch = self._lead(consumer)
            if not self.group.distributed:
                return command, msg, batch
            payload = ArrowCodec.encode_table(msg.table).tobytes() if msg is not None else b""
            self.group.broadcast_command(command, payload)
            return command, msg, batch
        command, payload = self.group.broadcast_command(None)
        batch = batch_rec.from_table(ArrowCodec.decode_table(payload)) if command is Command.TRAIN else None
        return command, None, batch

    def _lead(self, consumer: Any) -> tuple[Command, Any, Batch | None]:
        """Rank 0's decision for this turn: checkpoint when one falls due, stop at the step target (or
        when asked) once the last state is in a checkpoint, else the next admitted batch record and its
        batch."""
        due = self.step % self.tspec.checkpoint_every == 0 and self.step != self._last_ckpt_step
        if self.step >= self.tspec.steps or self.stop_event.is_set():
            return (Command.CHECKPOINT if self._checkpoint_due() else Command.STOP), None, None
        if due:
            return Command.CHECKPOINT, None, None
        msgs = consumer.poll(timeout_s=self.poll_timeout_s, max_records=1)
        self._emit_published()
        self.records.resend_refused()
        self._commit_saved(consumer)
        batch = self._admit(msgs[0]) if msgs else None
        if batch is None:
            return Command.IDLE, None, None
        return Command.TRAIN, msgs[0], batch

    def _admit(self, msg: Any) -> Batch | None:
        """The batch of a batch record; None (and the record marked for commit) for one not to train."""
        key = _offset_key(msg.topic, msg.partition)
        if key not in self._read_partitions:
            self._read_partitions.add(key)
            self._check_nothing_trimmed(key, msg.offset)
        if msg.offset < self.offsets.get(key, -1):
            self.skipped["already_checkpointed"] += 1
            self._uncommitted.append(msg)
            return None
        try:
            b = batch_rec.from_table(msg.table)
            if b.policy != self.policy:
                raise ValueError(f"batch for policy {b.policy!r} on {self.policy!r}'s topic")
        except Exception as exc:  # noqa: BLE001 - bad input: counted, skipped, never trained
            log.error("trainer %s: skipping batch record %s@%d: %s", self.policy, key, msg.offset, exc)
            self.skipped["invalid"] += 1
            self._consumed(msg)
            self._report_skipped("invalid", str(msg.key))  # batch records are keyed by their id
            return None
        if b.batch_id in self._trained:
            self.skipped["duplicate"] += 1
            self._consumed(msg)
            self._report_skipped("duplicate", b.batch_id)
            return None
        return b

    def _check_nothing_trimmed(self, key: str, first: int) -> None:
        """Say loudly when this life's first batch record of a partition lies beyond where its checkpoint
        reads from: the records between are gone from the log (trimmed by a retention that did not know the
        trainer's rollback position, e.g. an external broker's ``retention.ms``), and the batches in them
        are not trained in this lineage."""
        start = self.offsets.get(key)
        if start is not None and first > start:
            log.error("trainer %s: the log no longer has batch records %d..%d of %s that its checkpoint (step %d) "
                      "reads from: they are NOT trained in this lineage; training on from offset %d", self.policy,
                      start, first - 1, key, self.step, first)

    def _report_skipped(self, reason: str, batch_id: str) -> None:
        """The dataflow counts a batch it served as a version to come and its run's end as one batch
        nearer: tell it that this one trains neither."""
        self._emit(TrainerSkipped, reason=reason, batch_id=batch_id, step=self.step, version=self.version)

    def _consumed(self, msg: Any) -> None:
        self.offsets[_offset_key(msg.topic, msg.partition)] = msg.offset + 1
        self._uncommitted.append(msg)

    def _train(self, msg: Any, b: Any, wait_s: float) -> None:
        """One step on batch ``b`` (collective on a rank group); rank 0 (which holds its record
        ``msg``) publishes the new version and keeps its step record until it is announced."""
        trajs = b.trajectories
        stale = [self.version - t.min_version for t in trajs]
        handoff = HandoffLatency()
        if msg is not None:
            handoff.observe(msg.topic, msg.timestamp_ms)  # batch sent -> this step starts
        t0 = time.perf_counter()
        m = self.backend.step(trajs)
        step_s = time.perf_counter() - t0
        step_end = time.time()
        self.step += 1
        self.version += 1
        self.batch_ids.append(b.batch_id)
        self._trained.add(b.batch_id)
        self._forget_old_batch_ids()
        t1 = time.perf_counter()
        # every rank's own rows when each publishes its part; otherwise the whole weights (on a rank
        # group: gathered on rank 0, {} elsewhere)
        rows = self.backend.weight_rows(self._publish_dtype, on_device=self._encode_on_device) if self.publishes_rows else None
        served = self._served_state() if rows is None else rows.tensors
        t2 = time.perf_counter()
        if msg is None:
            if rows is not None:
                self.publisher.publish(rows.tensors, self.version, owned=True, rows=rows.rows, shapes=rows.shapes)
            return
        self._consumed(msg)
        record = self._step_record(b, m, stale, wait_s=wait_s, step_s=step_s, handoff_ms=handoff.drain())
        self.publisher.publish(served, self.version, owned=True, batch_id=b.batch_id,
                               **({} if rows is None else {"rows": rows.rows, "shapes": rows.shapes}))
        record["state_copy_s"] = t2 - t1  # the backend's copy + cast of the weights (the trainer waits)
        record["publish_blocked_s"] = time.perf_counter() - t2
        self._pending_records[self.version] = (record, step_end)

    def _step_record(self, b: Batch, m: dict[str, float], stale: list[int], *, wait_s: float, step_s: float,
                     handoff_ms: dict[str, dict]) -> dict[str, Any]:
        """The :class:`TrainerStep` fields known at the end of the step on batch ``b`` (the backend's
        figures ``m``; ``stale``: each trajectory's versions behind)."""
        trajs = b.trajectories
        record = {
            "step": self.step,
            "batch_id": b.batch_id,
            "loss": float(m.get("loss", float("nan"))),
            "reward_mean": float(m.get("reward_mean", sum(t.reward for t in trajs) / len(trajs))),
            "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(stale),
            "wait_s": wait_s,
            "step_s": step_s,
            "trajectories": len(trajs),
            "tokens": int(sum(sum(t.loss_mask) for t in trajs)),
            "grad_norm": float(m.get("grad_norm", 0.0)),
            "handoff_ms": handoff_ms,
        }
        # GRPO's share of trajectories without a learning signal, how many the backend trained on (fewer
        # with skip_zero_advantage), and its objective's diagnostics, when the backend reports them
        record.update({k: float(m[k]) for k in BACKEND_FIGURES if k in m})
        lengths = [len(t.response_ids) for t in trajs]
        record.update(response_len_mean=sum(lengths) / len(lengths), response_len_max=max(lengths),
                      truncated_frac=sum(t.rewards.get(TRUNCATED, 0.0) > 0 for t in trajs) / len(trajs))
        return record

    def _forget_old_batch_ids(self) -> None:
        """Keep the trained batch ids a checkpoint keeps (its ``keep_batch_ids`` newest), so that memory
        stays flat over a long run: a duplicate older than that window would pass after a restart too.
        Trimmed in halves, so that the cost is amortised."""
        keep = self.checkpoints.keep_batch_ids
        if len(self.batch_ids) > 2 * keep:
            self._trained.difference_update(self.batch_ids[:-keep])
            del self.batch_ids[:-keep]

    def _served_state(self) -> dict[str, Any]:
        return self.backend.published_weights(self._publish_dtype, on_device=self._encode_on_device)

    @property
    def _encode_on_device(self) -> bool:
        return self.tspec.encode_weights_on == "device"

    @property
    def _publish_dtype(self) -> Any:
        import torch

        return getattr(torch, self.tspec.publish_dtype)

    def _publish_now(self, version: int, batch_id: str | None = None) -> None:
        """Publish the weights as ``version`` and wait until it is (collective on a rank group)."""
        if self.publishes_rows:
            rows = self.backend.weight_rows(self._publish_dtype, on_device=self._encode_on_device)
            self.publisher.publish(rows.tensors, version, owned=True, batch_id=batch_id, rows=rows.rows,
                                   shapes=rows.shapes)
        else:
            state = self._served_state()  # gathered on rank 0 ({} elsewhere); fresh copies
            if not self.group.leader:
                return
            self.publisher.publish(state, version, owned=True, batch_id=batch_id)
        self.publisher.flush()
        if self.group.leader:
            self._emit_published()  # a bootstrap version has no step record: this only counts it as seen

    def _emit_published(self) -> None:
        """Step records whose version is now published, with the bytes it took."""
        # The publisher's thread appends meanwhile: take the new manifests and their count in one call (a
        # version appended between two reads would lose its step record for good).
        fresh, self._seen_published = self.publisher.published_after(self._seen_published)
        for manifest in fresh:
            announced = self.publisher.announced_at.pop(manifest.version, None)
            pending = self._pending_records.pop(manifest.version, None)
            if pending is not None:
                record, step_end = pending
                # step end -> announcement acknowledged: the hand-off from the trainer to the nodes
                publish_s = None if announced is None else round(announced - step_end, 4)
                self._emit(TrainerStep, **record, version=manifest.version, publish_bytes=manifest.bytes,
                           publish_kind=manifest.kind, publish_s=publish_s,
                           # this life's bucket housekeeping so far: weight versions and checkpoints deleted
                           weights_gc_deleted=self.publisher.gc_totals["versions"],
                           checkpoints_deleted=self.checkpoints.pruned_steps)

    def _emit(self, kind: type[TrainerRecord], **fields: Any) -> None:
        """Write a ``kind`` record (its model checks the fields) with this trainer's identity."""
        from astraflow.log import Topics

        record = kind(id=self.component_id, time=time.time(), policy=self.policy, life=self.life, **fields)
        send_control(self.records, Topics(self.cfg.run).metrics, self.component_id, record)


def run_trainer(cfg: ClusterConfig, recipe: Recipe, policy: str, stop_event: threading.Event, *,
                group: RankGroup | None = None, **options: Any) -> dict[str, Any]:
    """Train ``policy`` until ``recipe.trainer.steps`` steps or ``stop_event``; see the module docstring.
    ``group``: this process's rank group (default: as torch.distributed.run described it)."""
    group = current_group() if group is None else group
    # the group first: building the parts is collective (the life id) and the backend wants its device
    group.start(getattr(recipe.policy(policy).backend, "device", "cpu"))
    try:
        return TrainerService.from_config(cfg, recipe, policy, stop_event, group, **options).run()
    finally:
        group.close()
