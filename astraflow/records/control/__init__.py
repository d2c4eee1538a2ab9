"""Control records: the typed JSON records by which a component tells others what it did, each with its
own schema name and version in the record's headers.

Writers build a model and send it with :func:`send_control`; a record becomes its model again through
:func:`parse_control`, the one parse function there is: a consumer runs it on each record at decode
(importing this package registers it with the codec, :func:`~astraflow.log.codec.register_json_check`)
and hands the model out as ``Message.record``, or dead-letters a record that claims a control schema
but does not parse (reason ``bad-control-record``); a line of ``metrics.jsonl``, which has no headers,
is parsed with ``parse_control(None, None, line)``. A record's JSON keys are the ones it had before it was typed, so the readers of the JSON itself
(``metrics.jsonl``, the benchmarks, the archive's metric rows) read it as before.

* ``<run>.metrics``: the trainer's ``start``, ``step``, ``skipped``, ``done`` and ``checkpoint-refused``
  (:mod:`~astraflow.records.control.trainer`); a node's status, the dataflow's counters and its
  autoscaling report (:mod:`~astraflow.records.control.status`); log retention's records cut below a
  reader that held the log too long (:mod:`~astraflow.records.control.retention`).
* ``<run>.weights.<policy>``: the weight announcement (:mod:`~astraflow.records.control.weights`).
* ``metrics.jsonl`` only: the launcher's supervisor and actuator events
  (:mod:`~astraflow.records.control.launcher`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag, TypeAdapter, ValidationError

from astraflow.log.codec import METRICS_SCHEMA, register_json_check
from astraflow.records.control.base import ControlRecord, ControlRecordError
from astraflow.records.control.launcher import LAUNCHER_RECORDS, ActuatorEvent, SupervisorEvent
from astraflow.records.control.retention import RETENTION_RECORDS, LogRecordsDropped, LostRange
from astraflow.records.control.status import (
    STATUS_RECORDS,
    AutoscaleReport,
    DataflowCounters,
    NodeStatus,
    PoolReport,
)
from astraflow.records.control.trainer import (
    TRAINER_RECORDS,
    TrainerCheckpointRefused,
    TrainerDone,
    TrainerRecord,
    TrainerSkipped,
    TrainerStart,
    TrainerStep,
)
from astraflow.records.control.weights import WeightAnnouncement

CONTROL_RECORDS: dict[tuple[str, int], type[ControlRecord]] = {
    (m.SCHEMA_NAME, m.SCHEMA_VERSION): m
    for m in (*TRAINER_RECORDS, *STATUS_RECORDS, *LAUNCHER_RECORDS, *RETENTION_RECORDS, WeightAnnouncement)
}
"""(schema name, version) -> the model of every control record."""

METRICS_TOPIC_SCHEMAS: frozenset[tuple[str, int]] = frozenset(
    {METRICS_SCHEMA, *((m.SCHEMA_NAME, m.SCHEMA_VERSION)
                     for m in (*TRAINER_RECORDS, *STATUS_RECORDS, *RETENTION_RECORDS))})
"""What a reader of ``<run>.metrics`` accepts (``LogConsumer(expected_schemas={topic: ...})``): the
typed records, and untyped JSON (``json`` v1: a user's component's own figures, which steer nothing)."""


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors())


def parse_control(schema_name: str | None, schema_version: int | None, obj: Any) -> ControlRecord:
    """The record's model, from its headers' schema name and version and its JSON document; raises
    :class:`ControlRecordError` for an unknown schema or a document that does not fit it. Without a
    schema name (a line of ``metrics.jsonl``: a record of ``<run>.metrics`` or a launcher's event, without
    the log's headers) the model is known by the keys each kind has always had; a document none fits (a
    user's untyped figures, a damaged line) raises :class:`ControlRecordError` too."""
    if schema_name is None:
        return _parse_metrics_line(obj)
    model = CONTROL_RECORDS.get((schema_name, schema_version or 0))
    if model is None:
        raise ControlRecordError(f"no control record has schema {schema_name!r} v{schema_version} "
                                 f"(known: {sorted(CONTROL_RECORDS)})")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise ControlRecordError(f"not a {schema_name} v{schema_version} record: {_problems(exc)}") from None


def is_control(schema_name: str | None, schema_version: int | None) -> bool:
    """Whether a record's headers name a control record (:func:`parse_control` reads it)."""
    return (schema_name or "", schema_version or 0) in CONTROL_RECORDS


_METRICS_JSON_MODELS: tuple[type[ControlRecord], ...] = (*TRAINER_RECORDS, *STATUS_RECORDS, *LAUNCHER_RECORDS,
                                                         *RETENTION_RECORDS)


def _metrics_json_schema(obj: Any) -> str | None:
    """Which record a headerless JSON document of ``metrics.jsonl`` is, by the keys each kind has always
    had (``kind``, ``component``, ``event``); None: none of them."""
    if not isinstance(obj, dict):
        return None
    kind, component, event = obj.get("kind"), obj.get("component"), obj.get("event")
    model: type[ControlRecord] | None
    if kind in ("supervisor", "actuator"):
        model = SupervisorEvent if kind == "supervisor" else ActuatorEvent
    elif kind == "log-retention":
        model = LogRecordsDropped
    elif component == "raas":
        model = NodeStatus
    elif component == "dataflow":
        model = {"dataflow": DataflowCounters, "autoscale": AutoscaleReport}.get(kind)
    elif component == "trainer":
        model = {None: TrainerStep, "start": TrainerStart, "skipped": TrainerSkipped, "done": TrainerDone,
                 "checkpoint-refused": TrainerCheckpointRefused}.get(event)
    else:
        model = None
    return None if model is None else model.SCHEMA_NAME


_METRICS_JSON: TypeAdapter[ControlRecord] = TypeAdapter(Annotated[
    Union[tuple(Annotated[m, Tag(m.SCHEMA_NAME)] for m in _METRICS_JSON_MODELS)],  # noqa: UP007
    Discriminator(_metrics_json_schema)])


def _parse_metrics_line(obj: Any) -> ControlRecord:
    try:
        return _METRICS_JSON.validate_python(obj)
    except ValidationError as exc:
        raise ControlRecordError(f"not a metrics record: {_problems(exc)}") from None


SENT_RECORD_OBSERVERS: list[Callable[[ControlRecord], None]] = []
"""Told every record this process sends (its Prometheus endpoint, :mod:`astraflow.prometheus`)."""


def send_control(sender: Any, topic: str, key: str, record: ControlRecord, *, policy: str | None = None) -> Any:
    """Send ``record`` through ``sender`` (a :class:`~astraflow.log.LogProducer` or
    :class:`~astraflow.log.until_acked.UntilAcked`) with its schema name and version in the headers;
    returns what the sender's ``send_json`` returns."""
    for observe in SENT_RECORD_OBSERVERS:
        observe(record)
    extra = {} if policy is None else {"policy": policy}
    return sender.send_json(topic, key, record.to_json(), schema_name=record.SCHEMA_NAME,
                            schema_version=record.SCHEMA_VERSION, **extra)


def _check(schema_name: str, schema_version: int) -> Any:
    return lambda obj: parse_control(schema_name, schema_version, obj)


for _name, _version in CONTROL_RECORDS:
    register_json_check(_name, _version, _check(_name, _version))

__all__ = [
    "CONTROL_RECORDS", "METRICS_TOPIC_SCHEMAS", "ActuatorEvent", "AutoscaleReport", "ControlRecord",
    "ControlRecordError", "DataflowCounters", "LogRecordsDropped", "LostRange", "NodeStatus", "PoolReport", "SupervisorEvent",
    "TrainerCheckpointRefused", "TrainerDone",
    "TrainerRecord", "TrainerSkipped", "TrainerStart", "TrainerStep", "WeightAnnouncement", "is_control",
    "parse_control", "send_control",
]
