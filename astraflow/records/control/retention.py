"""What log retention says when a reader held the log longer than the run allows: the records it cut
below that reader's position anyway (``kafka.retention.max_held_records``), on ``<run>.metrics``."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.records.control.base import ControlRecord

if TYPE_CHECKING:
    from astraflow.log.retention import Cut


class LostRange(BaseModel):
    """The offsets one reader had not read (committed past) that left the log."""

    model_config = ConfigDict(extra="ignore")
    group: str
    """The reader's consumer group (``<run>.archive``, ``<run>.dataflow-recovery``, ...)."""
    first: int = Field(ge=0)
    """First offset lost to it."""
    last: int = Field(ge=0)
    """Last offset lost to it (inclusive)."""


class LogRecordsDropped(ControlRecord):
    """One partition trimmed below a reader's position, because its readers held more than
    ``max_held_records`` behind the log's end (key: the trimming component)."""

    SCHEMA_NAME: ClassVar[str] = "log-records-dropped"
    SCHEMA_VERSION: ClassVar[int] = 1
    component: str
    """The component that trims the run's log (``dataflow``; ``archive`` with ``--trim-log``)."""
    kind: Literal["log-retention"] = "log-retention"
    """Tells the record apart in ``metrics.jsonl``."""
    event: Literal["records-dropped"] = "records-dropped"
    time: float
    """Unix time of the trim."""
    topic: str
    partition: int = Field(ge=0)
    log_start: int = Field(ge=0)
    """The partition's first offset after the trim."""
    stored_end: int = Field(ge=0)
    """The first offset of the partition's last stored batch when the trim was decided (the log reached
    at least this far)."""
    max_held_records: int = Field(ge=1)
    """The limit in force (``kafka.retention.max_held_records``)."""
    lost: list[LostRange]
    """Per reader below the new start: the offsets it had not read that are gone."""

    @classmethod
    def of(cls, cut: Cut, *, component: str, time: float) -> LogRecordsDropped:
        return cls(component=component, time=time, topic=cut.partition[0], partition=cut.partition[1],
                   log_start=cut.log_start, stored_end=cut.stored_end, max_held_records=cut.max_held_records,
                   lost=[LostRange(group=g, first=a, last=b) for g, (a, b) in sorted(cut.lost.items())])


RETENTION_RECORDS: tuple[type[ControlRecord], ...] = (LogRecordsDropped,)
