"""Topic administration: create a run's topics, idempotently, and fail fast when no broker answers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from astraflow.log.errors import BrokerUnavailableError, LogError
from astraflow.log.topics import validate_topic_name

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

TOPIC_ALREADY_EXISTS = 36  # Kafka error code
C = TypeVar("C")


def open_kafka_client(factory: Callable[..., C], who: str, cfg: ClusterConfig, timeout_s: float, /,
                      **kwargs: Any) -> C:
    """A kafka-python client ``factory`` connected with the cluster config's settings, waiting at most
    ``timeout_s`` for a broker; ``kwargs`` add client-specific settings (and may override).
    :class:`BrokerUnavailableError` names ``who`` and the bootstrap when no broker answers (a
    configuration error, which no broker can fix, propagates as it is)."""
    from kafka.errors import KafkaConfigurationError, KafkaError

    settings = {**cfg.kafka.client_kwargs(), "bootstrap_timeout_ms": int(timeout_s * 1000), **kwargs}
    try:
        return factory(**settings)
    except KafkaConfigurationError:
        raise
    except KafkaError as exc:
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
) -> list[str]:
    """Create each ``{name: partitions}`` topic that does not exist yet; return the names created.

    Existing topics are left as they are (their partition count is not changed).
    ``replication_factor=-1`` takes the broker's default.
    """
    from kafka.errors import KafkaError

    for name, partitions in topics.items():
        validate_topic_name(name)
        if not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"topic {name}: partitions must be a positive int, got {partitions!r}")
    if not topics:
        return []
    admin = open_admin(cfg, timeout_s)
    try:
        spec = {name: {"num_partitions": n, "replication_factor": replication_factor} for name, n in topics.items()}
        try:
            result = admin.create_topics(spec, timeout_ms=int(timeout_s * 1000), raise_errors=False)
        except KafkaError as exc:
            raise LogError(f"creating topics {sorted(topics)} on {cfg.kafka.bootstrap} failed: {exc}") from None
        created, failed = [], []
        for topic in result["topics"]:
            code = topic["error_code"]
            if code == 0:
                created.append(topic["name"])
            elif code != TOPIC_ALREADY_EXISTS:
                failed.append(f"{topic['name']}: error {code} {topic.get('error_message') or ''}".strip())
        if failed:
            raise LogError(f"broker {cfg.kafka.bootstrap} refused to create topics: {'; '.join(failed)}")
        return created
    finally:
        admin.close()
