"""Shared fixtures: a real Kafka broker and a real S3 bucket for the whole test session.

Where the cluster comes from is chosen, never guessed from what happens to run on the machine:

1. ``ASTRAFLOW_TEST_STACK=external``, or ``ASTRAFLOW_KAFKA_BOOTSTRAP`` / ``ASTRAFLOW_S3_ENDPOINT`` set:
   those external endpoints (with the other ``ASTRAFLOW_*`` variables: keys, bucket, SASL/TLS).
2. ``ASTRAFLOW_TEST_STACK=docker``: Apache Kafka-compatible (testcontainers' Kafka) and MinIO
   containers, on the Docker engine the environment names (their images must be pullable).
3. Otherwise (the default): the embedded stack (Tansu + SeaweedFS) in a temporary state dir on free
   loopback ports, with Tansu's in-memory log for speed (``ASTRAFLOW_TEST_LOG_STORAGE=s3`` for the
   durable one). It is stopped at session end, and dies with pytest even if pytest is killed.

A Docker engine that merely answers does not switch the suite to containers: one that cannot pull
images (a registry out of reach) made the suite error when it did.

Each test gets its own run id through ``test_cluster`` (topics ``<run>.*``, bucket prefix
``<run>/``), so tests never see each other's records.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from astraflow.config import ClusterConfig, ConfigError, KafkaSettings, S3Settings

TEST_BUCKET = "astraflow"


# -- where the cluster comes from ------------------------------------------------------------
def _choose_stack() -> str:
    forced = os.environ.get("ASTRAFLOW_TEST_STACK")
    if forced:
        if forced not in ("external", "docker", "embedded"):
            raise pytest.UsageError(f"ASTRAFLOW_TEST_STACK must be external|docker|embedded, not {forced!r}")
        return forced
    if os.environ.get("ASTRAFLOW_KAFKA_BOOTSTRAP") or os.environ.get("ASTRAFLOW_S3_ENDPOINT"):
        return "external"
    return "embedded"


def _external_cluster() -> ClusterConfig:
    cfg = ClusterConfig.load()
    missing = [
        name
        for name, value in (("ASTRAFLOW_KAFKA_BOOTSTRAP", cfg.kafka.bootstrap), ("ASTRAFLOW_S3_ENDPOINT", cfg.s3.endpoint))
        if not value
    ]
    if missing:
        raise ConfigError(f"external test cluster: {' and '.join(missing)} not set (both are needed)")
    return cfg.model_copy(update={"run": "tests"})


def _docker_cluster(stack: list) -> ClusterConfig:
    import boto3
    from testcontainers.community.kafka import KafkaContainer
    from testcontainers.core.container import DockerContainer

    kafka = KafkaContainer().with_kraft()
    stack.append(kafka)
    kafka.start()
    access, secret = "astraflow", "astraflow-" + uuid.uuid4().hex[:12]
    minio = (
        DockerContainer("minio/minio:RELEASE.2024-10-13T13-34-11Z")
        .with_command("server /data")
        .with_env("MINIO_ROOT_USER", access)
        .with_env("MINIO_ROOT_PASSWORD", secret)
        .with_exposed_ports(9000)
    )
    stack.append(minio)
    minio.start()
    endpoint = f"http://{minio.get_container_host_ip()}:{minio.get_exposed_port(9000)}"
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access,
                      aws_secret_access_key=secret, region_name="us-east-1")
    deadline = time.monotonic() + 60
    while True:
        try:
            s3.create_bucket(Bucket=TEST_BUCKET)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    return ClusterConfig(
        run="tests",
        kafka=KafkaSettings(bootstrap=kafka.get_bootstrap_server()),
        s3=S3Settings(endpoint=endpoint, access_key=access, secret_key=secret, bucket=TEST_BUCKET),
    )


def _embedded_cluster(state_dir, stack: list) -> ClusterConfig:
    from astraflow.embedded import EmbeddedStack

    storage = os.environ.get("ASTRAFLOW_TEST_LOG_STORAGE", "memory")
    embedded, _ = EmbeddedStack.start_private(state_dir, storage=storage)
    stack.append(embedded)
    return ClusterConfig(run="tests", state_dir=state_dir).resolve()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterConfig]:
    """A resolved :class:`ClusterConfig` pointing at a real Kafka broker and a real S3 bucket."""
    kind = _choose_stack()
    started: list = []
    try:
        if kind == "external":
            cfg = _external_cluster()
        elif kind == "docker":
            cfg = _docker_cluster(started)
        else:
            cfg = _embedded_cluster(tmp_path_factory.mktemp("astraflow-stack"), started)
        yield cfg
    finally:
        for part in reversed(started):
            if hasattr(part, "down"):
                part.down()
            else:
                part.stop()


@pytest.fixture(scope="session")
def secure_stack(tmp_path_factory: pytest.TempPathFactory):
    """A secured embedded stack (``astraflow up --secure``: mutual TLS on the log, HTTPS and one
    identity per role on the bucket), started for the tests that ask for it."""
    from astraflow.embedded import EmbeddedStack

    stack, _ = EmbeddedStack.start_private(tmp_path_factory.mktemp("secure-stack"), storage="memory", secure=True)
    try:
        yield stack
    finally:
        stack.down()


@pytest.fixture
def secure_role(secure_stack, unique_name) -> Callable[[str], ClusterConfig]:
    """``role -> ClusterConfig`` on :func:`secure_stack` with that role's credential file, for one run
    of the test's own."""
    from astraflow.security.material import SecureMaterial

    run = unique_name("sec")

    def make(role: str) -> ClusterConfig:
        env = {"ASTRAFLOW_STATE_DIR": str(secure_stack.state_dir), "ASTRAFLOW_RUN": run,
               "ASTRAFLOW_CREDENTIALS_FILE": str(SecureMaterial(secure_stack.state_dir).credentials_file(role))}
        return ClusterConfig.load(env=env).resolve()

    return make


def _slug(text: str, limit: int = 40) -> str:
    """A test's node name as a safe topic/run fragment (Kafka allows ``[A-Za-z0-9._-]``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:limit] or "t"


@pytest.fixture
def test_cluster(cluster: ClusterConfig, request: pytest.FixtureRequest) -> ClusterConfig:
    """``cluster`` with a run id of its own: its topics (``<run>.*``) and bucket prefix
    (``<run>/``) are this test's alone."""
    run = f"{_slug(request.node.name)}-{uuid.uuid4().hex[:8]}"
    return cluster.model_copy(update={"run": run})


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """A factory of names no other test (or earlier run) uses: ``unique_name("group")`` ->
    ``group-test_foo-1a2b3c4d``. For topics, consumer groups, producer ids, keys."""
    base = _slug(request.node.name)

    def make(prefix: str = "") -> str:
        return "-".join(part for part in (_slug(prefix) if prefix else "", base, uuid.uuid4().hex[:8]) if part)

    return make


# -- the demo's tiny checkpoint ------------------------------------------------------------------
TINY_SPEC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "models",
                         "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The demo's tiny model, materialised once as a real checkpoint directory (save_pretrained +
    its own BPE tokenizer and chat template): the path a user's checkpoint takes."""
    from astraflow.models import resolve_checkpoint

    return resolve_checkpoint(TINY_SPEC)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint):
    from astraflow.models import load_tokenizer

    return load_tokenizer(tiny_checkpoint)


@pytest.fixture
def tiny_model(tiny_checkpoint):
    """A fresh copy of the tiny model (tests may train it)."""
    from astraflow.models import load_model

    return load_model(tiny_checkpoint)
