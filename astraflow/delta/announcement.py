"""The weight announcement: the control record on ``<run>.weights.<policy>`` saying that a version is
published (its manifest is in the bucket). Written by :class:`~astraflow.delta.WeightPublisher` after
the manifest; read by RaaS nodes (which refresh to it), the dataflow (the version that staleness is
counted from) and the archive (the weight timeline). JSON, schema ``weight-announcement`` v1."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from astraflow.delta.manifest import Manifest


class WeightAnnouncement(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a newer writer may add fields; readers keep working
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
    subscriber following the topic need not read it back (:meth:`carried_manifest`)."""

    @classmethod
    def of(cls, obj: object) -> WeightAnnouncement | None:
        """A record's JSON as an announcement, or None when it is not one."""
        try:
            return cls.model_validate(obj)
        except ValidationError:
            return None

    def carried_manifest(self) -> Manifest | None:
        """The manifest this announcement carries, if it carries one that is its own version's (same
        policy, version and state digest); None otherwise (read it from the bucket)."""
        if self.manifest_body is None:
            return None
        try:
            manifest = Manifest.model_validate(self.manifest_body)
        except ValidationError:
            return None
        if (manifest.policy, manifest.version, manifest.state_digest) != (self.policy, self.version, self.checksum):
            return None
        return manifest
