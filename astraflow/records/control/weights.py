"""The weight announcement on ``<run>.weights.<policy>`` (key: the version)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA
from astraflow.records.control.base import ControlRecord


class WeightAnnouncement(ControlRecord):
    """A weight version is published (its manifest is in the bucket). Written by
    :class:`~astraflow.delta.WeightPublisher` after the manifest; read by RaaS nodes (which refresh to it;
    with :func:`astraflow.delta.carried_manifest`, the manifest it may carry), the
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

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)
