"""Control records: the typed JSON records by which a component tells others what it did, each with its
own schema name and version in the record's headers.

Writers build a model and send it with :func:`send_control`; readers turn a record back into its model
with :func:`parse_control`, the one parse function both sides share. Importing this module registers
each model's check with the codec (:func:`~astraflow.log.codec.register_json_check`), so a consumer
dead-letters a record that claims a control schema but does not parse (reason ``bad-control-record``)
instead of handing it to a reader. A record's JSON keys are the ones it had before it was typed, so the
readers of the JSON itself (``metrics.jsonl``, the launcher's progress, the benchmarks, the archive's
metric rows) read it as before.

Typed so far: the trainer's ``start``, ``step``, ``skipped`` and ``done`` records on ``<run>.metrics``
and the weight announcement on ``<run>.weights.<policy>``. The nodes' status, the dataflow's counters,
its autoscaling report and the launcher's supervisor events are still untyped JSON (``json`` v1).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from astraflow.log.codec import METRICS_SCHEMA, WEIGHT_ANNOUNCEMENT_SCHEMA, register_json_check
from astraflow.log.errors import DecodeError


class ControlRecordError(DecodeError):
    """A record that claims a control schema is not one: an unknown schema name or version, a field
    missing or of the wrong type. Raised by :func:`parse_control`; a consumer dead-letters the record."""

    reason = "bad-control-record"


def _absent(value: Any) -> bool:
    return value is None


class ControlRecord(BaseModel):
    """A control record: its schema name and version, and its JSON document."""

    model_config = ConfigDict(extra="ignore")  # a newer writer may add fields; readers keep working
    SCHEMA_NAME: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int]

    def to_json(self) -> dict[str, Any]:
        """The record's JSON document. Python mode: a NaN loss stays NaN, as the codec's ``json.dumps``
        has always written it (pydantic's JSON mode would write null)."""
        return self.model_dump()


# -- the trainer's records on <run>.metrics (key: the trainer's component id) ---------------------------
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
    warm_start: dict[str, Any] | None = Field(default=None, exclude_if=_absent)
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
    zero_adv_frac: float | None = Field(default=None, exclude_if=_absent)
    """GRPO's share of trajectories without a learning signal, when the backend reports it."""
    trained_trajectories: float | None = Field(default=None, exclude_if=_absent)
    """Trajectories the backend trained on (fewer with ``skip_zero_advantage``), when it reports them."""
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


# -- <run>.weights.<policy> (key: the version) -----------------------------------------------------------
class WeightAnnouncement(ControlRecord):
    """A weight version is published (its manifest is in the bucket). Written by
    :class:`~astraflow.delta.WeightPublisher` after the manifest; read by RaaS nodes (which refresh to it;
    they use :class:`astraflow.delta.WeightAnnouncement`, which adds the manifest it may carry), the
    dataflow (the version that staleness is counted from) and the archive (the weight timeline)."""

    SCHEMA_NAME: ClassVar[str] = WEIGHT_ANNOUNCEMENT_SCHEMA[0]
    SCHEMA_VERSION: ClassVar[int] = WEIGHT_ANNOUNCEMENT_SCHEMA[1]
    version: int = Field(ge=0)
    """The version published."""
    policy: str
    """Whose weights."""
    kind: Literal["anchor", "delta"]
    """The manifest's kind: ``anchor`` when a full checkpoint is stored at this version."""
    manifest: str
    """Bucket key of the version's manifest."""
    bytes: int
    """Bytes of the objects the manifest names."""
    checksum: str
    """The manifest's ``state_digest``: one checksum for the whole state."""
    batch_id: str | None = None
    """The last batch trained into these weights: the batch of the step that made this version, or for a
    checkpoint a restarted trainer republishes under a fresh version, the last batch in it. None for
    weights trained on no batch (v0, a warm start). The dataflow counts staleness from it
    (:meth:`Dataflow.on_weights <astraflow.dataflow.pipeline.Dataflow.on_weights>`)."""
    manifest_body: dict[str, Any] | None = None
    """The manifest itself, for models of up to ``ANNOUNCED_MANIFEST_MAX_TENSORS`` tensors, so that a
    subscriber following the topic need not read it back."""

    @classmethod
    def of(cls, obj: object) -> WeightAnnouncement | None:
        """A record's JSON as an announcement, or None when it is not one."""
        try:
            return cls.model_validate(obj)
        except ValidationError:
            return None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


TRAINER_RECORDS: tuple[type[TrainerRecord], ...] = (TrainerStart, TrainerStep, TrainerSkipped, TrainerDone)

CONTROL_RECORDS: dict[tuple[str, int], type[ControlRecord]] = {
    (m.SCHEMA_NAME, m.SCHEMA_VERSION): m for m in (*TRAINER_RECORDS, WeightAnnouncement)
}
"""(schema name, version) -> the model of every control record."""

METRICS_TOPIC_SCHEMAS: frozenset[tuple[str, int]] = frozenset(
    {METRICS_SCHEMA, *((m.SCHEMA_NAME, m.SCHEMA_VERSION) for m in TRAINER_RECORDS)})
"""What a reader of ``<run>.metrics`` accepts (``LogConsumer(expected_schemas={topic: ...})``): the
untyped metrics records and the trainer's typed ones."""


def parse_control(schema_name: str | None, schema_version: int | None, obj: Any) -> ControlRecord:
    """The record's model, from its headers' schema name and version and its JSON document; raises
    :class:`ControlRecordError` for an unknown schema or a document that does not fit it."""
    model = CONTROL_RECORDS.get((schema_name or "", schema_version or 0))
    if model is None:
        raise ControlRecordError(f"no control record has schema {schema_name!r} v{schema_version} "
                                 f"(known: {sorted(CONTROL_RECORDS)})")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors())
        raise ControlRecordError(f"not a {schema_name} v{schema_version} record: {problems}") from None


def is_control(schema_name: str | None, schema_version: int | None) -> bool:
    """Whether a record's headers name a control record (:func:`parse_control` reads it)."""
    return (schema_name or "", schema_version or 0) in CONTROL_RECORDS


def send_control(sender: Any, topic: str, key: str, record: ControlRecord, *, policy: str | None = None) -> Any:
    """Send ``record`` through ``sender`` (a :class:`~astraflow.log.LogProducer` or
    :class:`~astraflow.log.until_acked.UntilAcked`) with its schema name and version in the headers;
    returns what the sender's ``send_json`` returns."""
    extra = {} if policy is None else {"policy": policy}
    return sender.send_json(topic, key, record.to_json(), schema_name=record.SCHEMA_NAME,
                            schema_version=record.SCHEMA_VERSION, **extra)


def _check(schema_name: str, schema_version: int) -> Any:
    return lambda obj: parse_control(schema_name, schema_version, obj)


for _name, _version in CONTROL_RECORDS:
    register_json_check(_name, _version, _check(_name, _version))
