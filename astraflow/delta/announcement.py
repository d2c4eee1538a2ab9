"""The weight announcement as RaaS nodes read it: the control record on ``<run>.weights.<policy>``
(:class:`astraflow.records.control.WeightAnnouncement`, schema ``weight-announcement`` v1: its fields,
its parsing, its check at decode) plus the manifest it may carry. Written by
:class:`~astraflow.delta.WeightPublisher` after the manifest. The record itself lives with the other
control records so that its readers (the dataflow, the archive) need not import the weight plane."""

from __future__ import annotations

from pydantic import ValidationError

from astraflow.delta.manifest import Manifest
from astraflow.records import control


class WeightAnnouncement(control.WeightAnnouncement):
    """The announcement record, with :meth:`carried_manifest`."""

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
