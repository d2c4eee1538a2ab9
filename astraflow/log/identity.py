"""Is this the log a checkpoint was taken on? Topic ids and earliest offsets.

Why: offsets saved in the bucket (the dataflow's consumed offsets and in-flight task positions, the
trainer's consumed batch offsets) only mean something on the log they were read from. When that log
is lost — an in-memory broker restarted, topics deleted and re-created, records aged out by
retention — a resumed component that trusts them skips new records that happen to sit below a saved
offset, or waits for records that no longer exist. Two facts tell it apart, neither of which relies
on high watermarks (which Tansu reports wrongly):

* a topic's **id**, a UUID the broker assigns when the topic is created: a re-created topic has a
  new one, so every saved offset into the old one is void;
* a partition's **earliest offset**: records below it were deleted (retention), the rest stand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from astraflow.log.offsets import Partition
from astraflow.log.retry import DEFAULT_DEADLINE_S, retry_transient

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

NO_ID = "00000000-0000-0000-0000-000000000000"
"""What a broker without topic ids (Kafka < 2.8) answers."""


def topic_ids(cfg: ClusterConfig, topics: Iterable[str], *, deadline_s: float = DEFAULT_DEADLINE_S
              ) -> dict[str, str | None]:
    """Each topic's id; None for a topic that does not exist or a broker that gives no ids."""
    from astraflow.log.admin import open_admin

    names = sorted(set(topics))
    if not names:
        return {}

    def attempt(timeout_s: float) -> dict[str, str | None]:
        admin = open_admin(cfg, timeout_s)
        try:
            described = admin.describe_topics(names)
        finally:
            admin.close()
        out: dict[str, str | None] = dict.fromkeys(names)
        for topic in described:
            tid = topic.get("topic_id")
            if topic.get("error_code", 0) == 0 and tid and str(tid) != NO_ID:
                out[topic["name"]] = str(tid)
        return out

    return retry_transient(attempt, what=f"describing topics {names}", endpoint=cfg.kafka.bootstrap,
                           deadline_s=deadline_s)


def topic_partitions(cfg: ClusterConfig, topics: Iterable[str], *, deadline_s: float = DEFAULT_DEADLINE_S
                     ) -> dict[str, int]:
    """Each existing topic's partition count, as the broker has it (a topic is created once, by whoever
    comes first, and keeps its count: a writer that hashes keys to partitions must use this one)."""
    from astraflow.log.admin import open_admin

    names = sorted(set(topics))
    if not names:
        return {}

    def attempt(timeout_s: float) -> dict[str, int]:
        admin = open_admin(cfg, timeout_s)
        try:
            described = admin.describe_topics(names)
        finally:
            admin.close()
        return {t["name"]: len(t["partitions"]) for t in described if t.get("error_code", 0) == 0 and t["partitions"]}

    return retry_transient(attempt, what=f"describing topics {names}", endpoint=cfg.kafka.bootstrap,
                           deadline_s=deadline_s)


def earliest_offsets(cfg: ClusterConfig, partitions: Iterable[Partition], *,
                     deadline_s: float = DEFAULT_DEADLINE_S) -> dict[Partition, int]:
    """The first offset still on the log for each partition (records below it were deleted)."""
    from kafka import KafkaConsumer, TopicPartition

    from astraflow.log.admin import open_kafka_client

    wanted = sorted(set(partitions))
    if not wanted:
        return {}

    def attempt(timeout_s: float) -> dict[Partition, int]:
        consumer = open_kafka_client(KafkaConsumer, "earliest-offsets probe", cfg, timeout_s,
                                     enable_auto_commit=False)
        try:
            got = consumer.beginning_offsets([TopicPartition(t, p) for t, p in wanted])
        finally:
            consumer.close()
        return {(tp.topic, tp.partition): int(off) for tp, off in got.items()}

    return retry_transient(attempt, what="reading earliest offsets", endpoint=cfg.kafka.bootstrap,
                           deadline_s=deadline_s)


def recreated_topics(saved: Mapping[str, str | None], current: Mapping[str, str | None]) -> set[str]:
    """Topics whose id changed since ``saved`` was recorded: every offset into them is void. A topic
    is judged only when both ids are known (an old checkpoint or a broker without ids says nothing)."""
    return {t for t, before in saved.items() if before and current.get(t) and current[t] != before}
