"""The manifest a weight announcement may carry, as RaaS nodes read it. The announcement itself is the
control record on ``<run>.weights.<policy>`` (:class:`astraflow.records.control.WeightAnnouncement`,
schema ``weight-announcement`` v1: its fields, its parsing, its check at decode), written by
:class:`~astraflow.delta.WeightPublisher` after the manifest; it lives with the other control records
so that its readers (the dataflow, the archive) need not import the weight plane."""

from __future__ import annotations

from pydantic import ValidationError

from astraflow.delta.manifest import Manifest
from astraflow.records.control import WeightAnnouncement


def carried_manifest(announcement: WeightAnnouncement) -> Manifest | None:
    """The manifest ``announcement`` carries, if it carries one that is its own version's (same policy,
    version and state digest); None otherwise (read it from the bucket)."""
    if announcement.manifest_body is None:
        return None
    try:
        manifest = Manifest.model_validate(announcement.manifest_body)
    except ValidationError:
        return None
    if (manifest.policy, manifest.version, manifest.state_digest) != (
            announcement.policy, announcement.version, announcement.checksum):
        return None
    return manifest
