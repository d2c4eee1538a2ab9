"""infra/docker-compose.yml: valid for Docker Compose, and consistent with the package it starts."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from astraflow.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "infra" / "docker-compose.yml"
DOCKERFILE = ROOT / "infra" / "Dockerfile"


def _compose_command() -> list[str] | None:
    """``docker compose`` (plugin) or ``docker-compose`` (standalone), if installed. ``config``
    needs no Docker engine, only the client."""
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30, check=False)
        if probe.returncode == 0:
            return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def _interpolate(value, env: dict[str, str]):
    """Compose's ``${VAR:-default}`` / ``${VAR}`` substitution (enough for this file)."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()), {})


def test_docker_compose_config_accepts_the_file():
    command = _compose_command()
    if command is None:
        pytest.skip("neither the `docker compose` plugin nor `docker-compose` is installed")
    result = subprocess.run([*command, "-f", str(COMPOSE), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_kafka_is_apache_kafka_in_kraft_mode(compose):
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}  # KRaft, no ZooKeeper
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", str(env["CLUSTER_ID"]))  # KRaft wants a base64 UUID
    assert "kafka:19092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "test" in kafka["healthcheck"]


def test_bucket_is_created_by_a_one_shot_service(compose):
    init = compose["services"]["minio-init"]
    script = " ".join(init["entrypoint"])
    assert "mc mb --ignore-existing" in script
    assert init["environment"]["S3_BUCKET"] == "astraflow"
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"


def test_published_ports_are_loopback_only(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)


@pytest.mark.parametrize("component", ["dataflow", "trainer", "raas"])
def test_components_run_the_cli_against_the_compose_cluster(compose, component):
    from astraflow.cli.main import build_parser

    service = compose["services"][component]
    assert service["build"]["dockerfile"] == "infra/Dockerfile"
    assert (COMPOSE.parent / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert service["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert service["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"

    # The command is one this package's CLI parses, with a recipe the image contains.
    command = service["command"]
    assert command[0] == component
    args = build_parser().parse_args(command)
    assert args.func is not None
    assert (ROOT / args.recipe).is_file(), args.recipe

    # The environment is a complete, valid cluster config pointing at the compose services.
    env = {k: str(v) for k, v in service["environment"].items()}
    cfg = ClusterConfig.load(env=env)
    assert not cfg.is_embedded
    assert cfg.kafka.bootstrap == "kafka:19092"
    assert cfg.s3.endpoint == "http://minio:9000"
    minio = compose["services"]["minio"]["environment"]
    assert (cfg.s3.access_key, cfg.s3.secret_key) == (minio["MINIO_ROOT_USER"], minio["MINIO_ROOT_PASSWORD"])
    assert cfg.s3.bucket == compose["services"]["minio-init"]["environment"]["S3_BUCKET"]


def test_dockerfile_installs_cpu_torch_before_the_package():
    text = DOCKERFILE.read_text()
    torch_at = text.index("torch==2.13.0")
    assert torch_at < text.index('pip install ".[hf]"')
    assert "ENTRYPOINT [\"astraflow\"]" in text
    for path in ("pyproject.toml", "astraflow", "examples"):
        assert (ROOT / path).exists()
