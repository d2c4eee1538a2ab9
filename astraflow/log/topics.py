"""Topic names of one run: ``<run>.tasks.<pool>``, ``<run>.trajectories``, ``<run>.batches.<policy>``,
``<run>.weights.<policy>``, ``<run>.metrics``, ``<run>.dead-letters``.

Kafka allows ``[A-Za-z0-9._-]`` and at most 249 characters. Pool and policy names may not contain a
dot, so a topic name splits back into its parts unambiguously after the run prefix.
"""

from __future__ import annotations

import re

from astraflow.log.errors import TopicNameError

_RUN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_TOPIC_LENGTH = 249

TASK_PARTITIONS = 4
"""Partitions of a pool's task topic, at least: a pool's nodes share its partitions (a node with none
idles), so a pool that may have more nodes gets one per node (:meth:`Topics.partitions`). The other
topics have one partition: one reader each (the dataflow, a policy's trainer, every node's own weight
subscriber), and one partition keeps their records in the order they were written."""


def validate_topic_name(name: str) -> str:
    """Return ``name`` if Kafka accepts it as a topic name, else raise :class:`TopicNameError`."""
    if not isinstance(name, str) or not _TOPIC.match(name) or name in {".", ".."}:
        raise TopicNameError(f"illegal Kafka topic name {name!r}: use only [A-Za-z0-9._-]")
    if len(name) > MAX_TOPIC_LENGTH:
        raise TopicNameError(f"topic name {name[:40]!r}... is {len(name)} characters; Kafka allows {MAX_TOPIC_LENGTH}")
    return name


def _part(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _PART.match(value):
        raise TopicNameError(
            f"illegal {kind} name {value!r}: start with a letter or digit, then [A-Za-z0-9_-] (no dots)"
        )
    return value


class Topics:
    """The topic names of run ``run``; every method validates what it builds."""

    def __init__(self, run: str) -> None:
        if not isinstance(run, str) or not _RUN.match(run):
            raise TopicNameError(f"illegal run id {run!r}: start with a letter or digit, then [A-Za-z0-9._-]")
        self.run = run

    def _name(self, *parts: str) -> str:
        return validate_topic_name(".".join((self.run, *parts)))

    def tasks(self, pool: str) -> str:
        """Tasks for the RaaS nodes of pool ``pool`` (one consumer group per pool)."""
        return self._name("tasks", _part("pool", pool))

    @property
    def trajectories(self) -> str:
        """Trajectories from every RaaS node to the dataflow."""
        return self._name("trajectories")

    def batches(self, policy: str) -> str:
        """Training batches for the trainer of ``policy``."""
        return self._name("batches", _part("policy", policy))

    def weights(self, policy: str) -> str:
        """Weight-version announcements of ``policy`` (the bytes live in the bucket)."""
        return self._name("weights", _part("policy", policy))

    @property
    def metrics(self) -> str:
        """Counters, rates and waits from every component."""
        return self._name("metrics")

    @property
    def dead_letters(self) -> str:
        """Records someone could not decode or validate, with the reason, bytes kept as they were."""
        return self._name("dead-letters")

    def partitions(self, pools: dict[str, int], policies: list[str]) -> dict[str, int]:
        """Every topic of the run with the partition count it is created with: ``pools`` maps a pool to
        the most nodes it may have. Existing topics keep theirs; writers that hash keys to partitions
        read the real count (:func:`astraflow.log.identity.topic_partitions`)."""
        topics = {self.trajectories: 1, self.metrics: 1, self.dead_letters: 1}
        topics.update({self.tasks(pool): max(TASK_PARTITIONS, nodes) for pool, nodes in pools.items()})
        for policy in policies:
            topics.update({self.batches(policy): 1, self.weights(policy): 1})
        return topics

    def __repr__(self) -> str:
        return f"Topics({self.run!r})"
