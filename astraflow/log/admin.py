"""Topic administration: create a run's topics, idempotently. Transient broker errors (a broker that
is still starting, a controller election, a timeout) are retried within a deadline; errors waiting
cannot cure (an invalid config) fail at once, naming the broker and the topic."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from astraflow.log.errors import BrokerRefusedError, BrokerUnavailableError, LogError, TransientBrokerError
from astraflow.log.retry import DEFAULT_DEADLINE_S, is_transient, retry_transient
from astraflow.log.topics import validate_topic_name

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

C = TypeVar("C")


CLIENT_METRICS_OFF = {"metrics_enabled": False}
"""For consumers and producers: kafka-python's own client metrics (sensors updated on every request,
fetch and record) are read by nothing here and cost CPU on every hand-off."""


def open_kafka_client(factory: Callable[..., C], who: str, cfg: ClusterConfig, timeout_s: float, /,
                      **kwargs: Any) -> C:
    """A kafka-python client ``factory`` connected with the cluster config's settings, waiting at most
    ``timeout_s`` for a broker; ``kwargs`` add client-specific settings (and may override).
    :class:`BrokerUnavailableError` names ``who`` and the bootstrap when no broker answers,
    :class:`BrokerRefusedError` the cause when TLS keeps it off (a configuration error, which no
    broker can fix, propagates as it is)."""
    from kafka.errors import KafkaConfigurationError, KafkaError

    from astraflow.log.tls_probe import tls_refusal

    settings = {**cfg.kafka.client_kwargs(), "bootstrap_timeout_ms": int(timeout_s * 1000), **kwargs}
    try:
        return factory(**settings)
    except KafkaConfigurationError:
        raise
    except KafkaError as exc:
        refusal = tls_refusal(cfg.kafka)
        if refusal is not None:
            raise BrokerRefusedError(f"{who}: {refusal}") from None
        raise BrokerUnavailableError(
            f"{who}: no Kafka broker answered at {cfg.kafka.bootstrap} within {timeout_s:g} s "
            f"({type(exc).__name__}: {exc}); is the stack up (`astraflow up`) or ASTRAFLOW_KAFKA_BOOTSTRAP right?"
        ) from None


def open_admin(cfg: ClusterConfig, timeout_s: float = 10.0) -> Any:
    """A KafkaAdminClient, or :class:`BrokerUnavailableError` naming the bootstrap within ``timeout_s``."""
    from kafka import KafkaAdminClient

    timeout_ms = int(timeout_s * 1000)
    return open_kafka_client(
        KafkaAdminClient,
        "admin",
        cfg,
        timeout_s,
        client_id=f"astraflow-admin-{cfg.run}",
        request_timeout_ms=timeout_ms,
        reconnect_backoff_max_ms=1000,
    )


def ensure_topics(
    cfg: ClusterConfig,
    topics: Mapping[str, int],
    *,
    replication_factor: int = -1,
    timeout_s: float = 10.0,
    deadline_s: float = DEFAULT_DEADLINE_S,
    admin_factory: Callable[[ClusterConfig, float], Any] = open_admin,
) -> list[str]:
    """Create each ``{name: partitions}`` topic that does not exist yet; return the names created.

    Existing topics are left as they are (their partition count is not changed).
    ``replication_factor=-1`` takes the broker's default. Each request waits at most ``timeout_s``;
    transient failures are retried until ``deadline_s`` (a topic whose creation timed out but went
    through is then found existing, and not listed as created). ``admin_factory`` opens the admin
    client (tests pass a fake to drive the retry loop).
    """
    for name, partitions in topics.items():
        validate_topic_name(name)
        if not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"topic {name}: partitions must be a positive int, got {partitions!r}")
    pending = dict(topics)
    created: list[str] = []

    def attempt(attempt_timeout_s: float) -> list[str]:
        admin = admin_factory(cfg, attempt_timeout_s)
        try:
            _create(admin, cfg.kafka.bootstrap, pending, created, replication_factor, attempt_timeout_s)
        finally:
            admin.close()
        return created

    if not topics:
        return []
    return retry_transient(attempt, what=f"creating topics {sorted(topics)}", endpoint=cfg.kafka.bootstrap,
                           deadline_s=deadline_s, attempt_timeout_s=timeout_s)


def _create(admin: Any, bootstrap: str, pending: dict[str, int], created: list[str], replication_factor: int,
            timeout_s: float) -> None:
    """One CreateTopics request for the ``pending`` topics: each one created or found existing leaves
    ``pending`` (the created ones join ``created``); raises :class:`TransientBrokerError` if some
    answered with a retriable error, :class:`LogError` at once if one was refused for good."""
    from kafka.errors import KafkaError, TopicAlreadyExistsError, for_code

    spec = {name: {"num_partitions": n, "replication_factor": replication_factor} for name, n in pending.items()}
    try:
        result = admin.create_topics(spec, timeout_ms=int(timeout_s * 1000), raise_errors=False)
    except KafkaError as exc:
        if is_transient(exc):
            raise
        raise LogError(f"broker {bootstrap} refused creating topics {sorted(pending)}: "
                       f"{type(exc).__name__}: {exc}") from None
    transient, failed = [], []
    for topic in result["topics"]:
        name, code = topic["name"], topic["error_code"]
        if code in (0, TopicAlreadyExistsError.errno):
            pending.pop(name, None)
            if code == 0:
                created.append(name)
            continue
        error = for_code(code)
        detail = f"{name}: {error.__name__} ({code}) {topic.get('error_message') or ''}".strip()
        (transient if error.retriable else failed).append(detail)
    if failed:
        raise LogError(f"broker {bootstrap} refused to create topics: {'; '.join(failed)}")
    if transient:
        raise TransientBrokerError(f"broker {bootstrap} could not create topics yet: {'; '.join(transient)}")


def ensure_run_topics(cfg: ClusterConfig, pools: dict[str, int], policies: list[str]) -> None:
    """Create the run's topics that do not exist yet with the launcher's partition counts
    (:meth:`~astraflow.log.topics.Topics.partitions`; ``pools``: pool -> its most nodes), all but the dead
    letters, which are left to their publisher (:mod:`astraflow.log.dead_letters`). For a component that
    may start before the launcher made them (a RaaS node or the dataflow started on its own)."""
    from astraflow.log.topics import Topics

    topics = Topics(cfg.run)
    run_topics = topics.partitions(pools, policies)
    ensure_topics(cfg, {t: n for t, n in run_topics.items() if t != topics.dead_letters})
