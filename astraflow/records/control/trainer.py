"""The trainer's records on ``<run>.metrics`` (key: the trainer's component id)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from astraflow.records.control.base import ControlRecord, absent


class TrainerRecord(ControlRecord):
    """The fields of every trainer record (the metrics contract: ``component`` and ``id``)."""

    component: Literal["trainer"] = "trainer"
    """The writer's kind of component."""
    id: str
    """The writer's component id, ``trainer.<policy>`` (also the record key)."""
    time: float
    """Unix time the record was written."""
    policy: str
    """The policy this trainer trains."""
    life: str
    """The trainer process's id: a restarted trainer has a new one."""


class TrainerStart(TrainerRecord):
    """A trainer process started (each life writes one)."""

    SCHEMA_NAME: ClassVar[str] = "trainer-start"
    SCHEMA_VERSION: ClassVar[int] = 1
    event: Literal["start"] = "start"
    """Tells the trainer's records apart in ``metrics.jsonl``."""
    step: int = Field(ge=0)
    """Steps taken before this life (from its checkpoint)."""
    version: int = Field(ge=0)
    """The weight version it starts from."""
    origin: str
    """Where its weights came from, in words (checkpoint, weight store, seeded model)."""
    warm_start: dict[str, Any] | None = Field(default=None, exclude_if=absent)
    """The SFT warm start's figures, when this life ran one; absent from the JSON otherwise."""


class TrainerStep(TrainerRecord):
    """One training step, written once its version is published. Has no ``event`` key: readers of the
    JSON tell step records by ``step`` without ``event``."""

    SCHEMA_NAME: ClassVar[str] = "trainer-step"
    SCHEMA_VERSION: ClassVar[int] = 1
    step: int = Field(ge=1)
    """Steps taken, this one included."""
    version: int = Field(ge=0)
    """The weight version the step published."""
    batch_id: str
    """The batch trained."""
    loss: float
    """The backend's loss (NaN when it reports none)."""
    reward_mean: float
    """Mean reward of the batch's trajectories."""
    staleness_mean: float
    """Mean of (trainer version - a trajectory's oldest token version) over the batch."""
    staleness_max: int
    """The largest of those."""
    wait_s: float
    """Seconds the trainer waited for this batch (the dataflow's autoscaler reads it)."""
    step_s: float
    """Seconds the backend's step took (the dataflow's autoscaler reads it)."""
    trajectories: int
    """Trajectories in the batch."""
    tokens: int
    """Trained tokens (loss mask ones) in the batch."""
    grad_norm: float
    """The backend's gradient norm (0 when it reports none)."""
    handoff_ms: dict[str, dict[str, Any]]
    """Batch sent -> step started, milliseconds, per topic (:class:`~astraflow.log.handoff.HandoffLatency`)."""
    zero_adv_frac: float | None = Field(default=None, exclude_if=absent)
    """GRPO's share of trajectories without a learning signal, when the backend reports it."""
    trained_trajectories: float | None = Field(default=None, exclude_if=absent)
    """Trajectories the backend trained on (fewer with ``skip_zero_advantage``), when it reports them."""
    updates_skipped: float | None = Field(default=None, exclude_if=absent)
    """Minibatches of the step that did not step the optimizer: every advantage in them was 0
    (``backend.step_without_signal`` off), when the backend reports it."""
    response_len_mean: float | None = Field(default=None, exclude_if=absent)
    """Mean response length in tokens (``response_ids``: model tokens and, in multi-turn episodes,
    environment tokens) over the batch's trajectories."""
    response_len_max: int | None = Field(default=None, exclude_if=absent)
    """The longest response of the batch, in tokens."""
    truncated_frac: float | None = Field(default=None, exclude_if=absent)
    """Share of the batch's trajectories cut at a token cap (``max_new_tokens``, or an agent's turn /
    context limit): their ``rewards["truncated"]`` figure, written by the workflow's transcript."""
    clip_frac: float | None = Field(default=None, exclude_if=absent)
    """Share of loss tokens whose ratio to the proximal policy lies outside the clip range, when the
    backend reports it."""
    behav_kl: float | None = Field(default=None, exclude_if=absent)
    """KL(behaviour || current), k3 estimator over the loss tokens: how off-policy the batch was,
    when the backend reports it."""
    entropy: float | None = Field(default=None, exclude_if=absent)
    """Mean token entropy of the current policy over the loss tokens (nats), when the backend reports it."""
    kl_ref: float | None = Field(default=None, exclude_if=absent)
    """Mean KL estimate to the frozen reference per token (``objective.kl``'s estimator: of the trained
    policy in loss mode, of the behaviour policy in reward mode), when the objective has a KL term."""
    state_copy_s: float
    """Seconds the backend's copy and cast of the weights took (the trainer waits for it)."""
    publish_blocked_s: float
    """Seconds the step waited on the publisher (more than ``max_publish_lag`` versions queued)."""
    publish_bytes: int
    """Bytes of the published version's objects."""
    publish_kind: Literal["anchor", "delta"]
    """Whether the version was stored as an anchor or a delta."""
    publish_s: float | None
    """Seconds from the step's end to its announcement being acknowledged; null when not known."""
    weights_gc_deleted: int
    """Weight versions this life deleted so far (``trainer.weights_gc_every``)."""
    checkpoints_deleted: int
    """Checkpoints this life deleted so far (``trainer.keep_checkpoints``)."""

    @property
    def busy_fraction(self) -> float:
        """Share of this step's time the trainer computed rather than waited for its batch."""
        total = self.step_s + self.wait_s
        return self.step_s / total if total > 0 else 0.0


class TrainerSkipped(TrainerRecord):
    """A batch the trainer will not train: the dataflow counts it neither as a version to come nor as a
    step of the run (:meth:`Dataflow.batch_skipped <astraflow.dataflow.pipeline.Dataflow.batch_skipped>`)."""

    SCHEMA_NAME: ClassVar[str] = "trainer-skipped"
    SCHEMA_VERSION: ClassVar[int] = 1
    event: Literal["skipped"] = "skipped"
    """Tells the trainer's records apart in ``metrics.jsonl``."""
    reason: Literal["duplicate", "invalid"]
    """``duplicate``: its id was trained already (a restarted dataflow re-produced it); ``invalid``: the
    record does not decode as a batch of this policy."""
    batch_id: str
    """The batch's id (for an invalid record: its key)."""
    step: int = Field(ge=0)
    """Steps taken when it was skipped."""
    version: int = Field(ge=0)
    """The trainer's weight version then."""


class TrainerDone(TrainerRecord):
    """The trainer took ``trainer.steps`` steps."""

    SCHEMA_NAME: ClassVar[str] = "trainer-done"
    SCHEMA_VERSION: ClassVar[int] = 1
    event: Literal["done"] = "done"
    """Tells the trainer's records apart in ``metrics.jsonl``."""
    step: int = Field(ge=0)
    """Steps taken."""
    version: int = Field(ge=0)
    """The last weight version."""
    skipped: dict[str, int]
    """Batch records not trained, by reason, over this life."""


class TrainerCheckpointRefused(TrainerRecord):
    """A checkpoint the trainer would have resumed from failed its checks (a part's sha256, a pointer
    that does not parse): it is refused, and the trainer falls back to the next older kept checkpoint."""

    SCHEMA_NAME: ClassVar[str] = "trainer-checkpoint-refused"
    SCHEMA_VERSION: ClassVar[int] = 1
    event: Literal["checkpoint-refused"] = "checkpoint-refused"
    """Tells the trainer's records apart in ``metrics.jsonl``."""
    step: int = Field(ge=0)
    """Steps this life had taken when it refused the checkpoint (0: at its start, the only time it reads one)."""
    refused_step: int | None = Field(ge=0)
    """The refused checkpoint's step; null when its pointer (``latest.json``) itself could not be read."""
    error: str
    """Why, naming the object at fault."""
    fallback_step: int | None = Field(ge=0)
    """The kept checkpoint tried next; null when none is left (the trainer stops with the error)."""


TRAINER_RECORDS: tuple[type[TrainerRecord], ...] = (TrainerStart, TrainerStep, TrainerSkipped, TrainerDone,
                                                    TrainerCheckpointRefused)
