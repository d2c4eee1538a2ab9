"""What every control record is: a typed JSON document with its own schema name and version."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from astraflow.log.errors import DecodeError


class ControlRecordError(DecodeError):
    """A record that claims a control schema is not one: an unknown schema name or version, a field
    missing or of the wrong type. Raised by :func:`parse_control`; a consumer dead-letters the record."""

    reason = "bad-control-record"


def absent(value: Any) -> bool:
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

    INDEX_FIELDS: ClassVar[tuple[str, ...]] = ("component", "kind", "event", "policy", "step", "time")
    """The fields readers index records of the metrics topic by (the archive's metric rows)."""

    def index_fields(self) -> dict[str, Any]:
        """:attr:`INDEX_FIELDS` of this record; None for each it does not have (a node has no step)."""
        values = self.model_dump(include=set(self.INDEX_FIELDS))
        return {name: values.get(name) for name in self.INDEX_FIELDS}
