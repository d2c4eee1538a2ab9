"""A reader's position, held where log retention sees it: the committed offsets of a consumer group
that never joins (Kafka's "simple" commits, ``OffsetCommit`` from an admin client).

Why: log retention trims a partition below what every reader of it has committed
(:mod:`astraflow.log.retention`). A reader that comes back for records it has already consumed — the
dataflow's recovery, which after a restart reads its own task and batch records from where its saved
state ends and looks up its in-flight tasks' records (:mod:`astraflow.dataflow.adoption`,
:mod:`astraflow.dataflow.recovery`) — is no member of any group reading them. It holds that position
explicitly instead, for as long as it is away, whatever the clock says: Kafka's own rule (a record a
group has not committed past stays, whatever its age).

A failed hold (the broker restarting) is logged and left: the position held before it is older, so it
keeps more of the log, never less.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from astraflow.log.offsets import Partition

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

log = logging.getLogger(__name__)


class HeldPosition:
    """Commits ``group``'s offsets on demand (:meth:`hold`); one admin connection, reopened after a failure."""

    def __init__(self, cfg: ClusterConfig, group: str) -> None:
        self.cfg, self.group = cfg, group
        self._admin: Any = None

    def hold(self, positions: Mapping[Partition, int]) -> bool:
        """Commit ``positions`` ((topic, partition) -> the next offset the reader will read) as the
        group's; True once the broker took every one."""
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        from astraflow.log.admin import open_admin

        if not positions:
            return True
        try:
            if self._admin is None:
                self._admin = open_admin(self.cfg)
            answers = self._admin.alter_group_offsets(
                self.group, {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in positions.items()})
        except Exception as exc:  # noqa: BLE001 - a position not moved keeps more of the log, never less
            log.warning("could not hold %s's log position (%s: %s); the last one held stays", self.group,
                        type(exc).__name__, exc)
            self.close()
            return False
        refused = {f"{tp.topic}:{tp.partition}": err.__name__ for tp, err in answers.items()
                   if getattr(err, "errno", 0) != 0}
        if refused:
            log.warning("the broker refused %s's log position on %s; the last one held stays", self.group, refused)
            return False
        return True

    def close(self) -> None:
        if self._admin is not None:
            try:
                self._admin.close()
            finally:
                self._admin = None
