"""The embedded stack (Tansu + SeaweedFS) and the session fixtures, against real processes.

Tests that start their own stack use a temp state dir and free ports, so they run beside the
session ``cluster`` and beside other people's stacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from e2e_helpers import free_block_plan
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError
from process_helpers import pid_alive

from astraflow.config import ClusterConfig
from astraflow.embedded import EmbeddedStack, StackError, StackPorts
from astraflow.embedded.seaweedfs import FILER_STORE_DIRS

pytestmark = pytest.mark.integration


# -- helpers ---------------------------------------------------------------------------------
def _s3(cfg: ClusterConfig):
    return boto3.client("s3", endpoint_url=cfg.s3.endpoint, aws_access_key_id=cfg.s3.access_key,
                        aws_secret_access_key=cfg.s3.secret_key, region_name=cfg.s3.region)


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    """Create ``topic`` (1 partition) and produce ``values``, each acknowledged (acks=all)."""
    admin = KafkaAdminClient(bootstrap_servers=[bootstrap])
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all")
    try:
        for future in [producer.send(topic, value=v) for v in values]:
            future.get(timeout=30)
    finally:
        producer.close()


def _consume_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 30) -> list[bytes]:
    """Read partition 0 of ``topic`` from the beginning (no consumer group, so no join wait)."""
    consumer = KafkaConsumer(bootstrap_servers=[bootstrap], enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        values: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while len(values) < expected and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                values.extend(r.value for r in records)
        return values
    finally:
        consumer.close()


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "astraflow.cli.main", *args],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def _port_args(ports: StackPorts) -> list[str]:
    # `up` takes Kafka, S3 and a base for SeaweedFS's internal ports; give it a plan of free ones.
    return ["--kafka-port", str(ports.kafka), "--s3-port", str(ports.s3),
            "--internal-port-base", str(ports.master)]


def _listening_addresses(pid: int) -> list[str]:
    """``ip:port`` of every TCP socket ``pid`` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            if width == 8:
                addr = socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr_hex)[::-1])
            else:
                raw = b"".join(bytes.fromhex(addr_hex[i:i + 8])[::-1] for i in range(0, 32, 8))
                addr = socket.inet_ntop(socket.AF_INET6, raw)
            found.append(f"{addr}:{int(port_hex, 16)}")
    return found


def _our_listeners(ports: StackPorts, state: Path) -> dict[str, list[int]]:
    """The plan's ports that a process of this stack still listens on: the servers run with the state
    dir as their working directory, and so would anything they left behind. Another test's stack (the
    other pytest worker's) may have picked one of the ports once they were free again, which is not a
    leftover of ours (seen once in CI: the master port taken after a clean down)."""
    plan = {port: name for name, port in ports.by_service().items()}
    held: dict[str, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if Path(os.readlink(proc / "cwd")).resolve() != state.resolve():
                continue
            addresses = _listening_addresses(int(proc.name))
        except OSError:
            continue
        for address in addresses:
            port = int(address.rsplit(":", 1)[1])
            if port in plan:
                held.setdefault(plan[port], []).append(int(proc.name))
    return held


# -- the session fixtures --------------------------------------------------------------------
def test_fixture_cluster_is_real_kafka_and_s3(test_cluster, unique_name):
    topic = f"{test_cluster.run}.smoke"
    values = [f"v{i}".encode() for i in range(5)]
    _produce(test_cluster.kafka.bootstrap, topic, values)
    assert _consume_all(test_cluster.kafka.bootstrap, topic, 5) == values

    s3 = _s3(test_cluster)
    key = f"{test_cluster.run}/smoke.bin"
    s3.put_object(Bucket=test_cluster.s3.bucket, Key=key, Body=b"hello")
    assert s3.get_object(Bucket=test_cluster.s3.bucket, Key=key)["Body"].read() == b"hello"


def test_unique_names_and_runs_differ(test_cluster, unique_name, cluster):
    assert unique_name("g") != unique_name("g")
    assert unique_name("group").startswith("group-test_unique_names_and_runs_differ-")
    assert test_cluster.run != cluster.run
    assert test_cluster.run.startswith("test_unique_names_and_runs_differ-")
    ClusterConfig.model_validate(test_cluster.model_dump())  # the run id is a valid one


# -- lifecycle through the CLI ---------------------------------------------------------------
def test_up_status_down_leaves_nothing_behind(tmp_path):
    state = tmp_path / "state"
    ports = free_block_plan()
    up = _cli("up", "--state-dir", str(state), "--log-storage", "memory", *_port_args(ports))
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"127.0.0.1:{ports.kafka}" in up.stdout and f"http://127.0.0.1:{ports.s3}" in up.stdout
    stack = json.loads((state / "stack.json").read_text())
    assert stack["kafka_bootstrap"] == f"127.0.0.1:{ports.kafka}"
    pids = [json.loads((state / f"{name}.pid").read_text())["pid"] for name in ("tansu", "seaweedfs")]
    try:
        assert all(pid_alive(pid) for pid in pids)
        # Nothing may listen beyond loopback; weed opens a dozen listeners.
        listening = [addr for pid in pids for addr in _listening_addresses(pid)]
        assert len(listening) >= 3, listening
        assert all(addr.startswith("127.0.0.1:") for addr in listening), listening
        assert {int(a.rsplit(":", 1)[1]) for a in listening} <= set(ports.by_service().values())

        # The state dir comes from --state-dir or, as for every component, ASTRAFLOW_STATE_DIR.
        status = _cli("status", env={"ASTRAFLOW_STATE_DIR": str(state)})
        assert status.returncode == 0, status.stdout + status.stderr
        assert str(pids[0]) in status.stdout and str(pids[1]) in status.stdout
        assert f"127.0.0.1:{ports.kafka}" in status.stdout
    finally:
        down = _cli("down", "--state-dir", str(state))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "Stopped" in down.stdout
    assert not any(pid_alive(pid) for pid in pids)
    assert not (state / "stack.json").exists()
    assert not _our_listeners(ports, state)

    after = _cli("status", "--state-dir", str(state))
    assert after.returncode == 1
    assert "astraflow up" in after.stdout  # says what to do
    again = _cli("down", "--state-dir", str(state))
    assert again.returncode == 0 and "Nothing was running" in again.stdout


def test_up_twice_is_harmless(tmp_path):
    stack = EmbeddedStack(tmp_path, StackPorts.free(), storage="memory", die_with_parent=True)
    try:
        first = stack.up()
        pids = [proc.pid() for proc in (stack.kafka, stack.s3)]
        second = stack.up()
        assert not first.already_running and second.already_running
        assert second.endpoints == first.endpoints
        assert [proc.pid() for proc in (stack.kafka, stack.s3)] == pids
        # A second stack object on the same state dir (another `astraflow up`) agrees.
        other = EmbeddedStack(tmp_path, StackPorts.free(), storage="memory")
        assert other.up().already_running
        # Credentials are generated once per state dir.
        assert first.endpoints["s3_secret_key"] == json.loads((tmp_path / "s3-credentials.json").read_text())["secret_key"]
    finally:
        stack.down()
    assert not any(pid_alive(pid) for pid in pids)


def test_fixture_stack_dies_with_a_killed_test_process(tmp_path):
    # What the session fixture relies on when pytest itself is killed (-9): no servers left over.
    script = (
        "import sys, json; from astraflow.embedded import EmbeddedStack, StackPorts\n"
        f"s = EmbeddedStack({str(tmp_path)!r}, StackPorts.free(), storage='memory', die_with_parent=True)\n"
        "s.up(); print(json.dumps([s.kafka.pid(), s.s3.pid()]), flush=True); sys.stdin.read()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        assert all(pid_alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in pids)


def test_taken_port_is_a_clear_error(tmp_path):
    ports = free_block_plan()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", ports.kafka))
        squatter.listen()
        with pytest.raises(StackError, match=rf"port {ports.kafka} \(Kafka broker \(Tansu\)\)"):
            EmbeddedStack(tmp_path / "a", ports, storage="memory").up()
        assert not list((tmp_path / "a").glob("*.pid"))  # nothing was started

        cli = _cli("up", "--state-dir", str(tmp_path / "b"), *_port_args(ports))
        assert cli.returncode == 1
        assert f"port {ports.kafka} (Kafka broker (Tansu))" in " ".join(cli.stdout.split())
        assert "--kafka-port" in cli.stdout


def test_help_texts_name_the_options():
    for command, words in (("up", ["--log-storage", "--kafka-port", "--s3-port", "--state-dir", "durable",
                                   "(default: s3)"]),
                           ("run", ["--log-storage", "durable", "memory"]),
                           ("down", ["SIGKILL", "--state-dir"]),
                           ("status", ["pid", "--state-dir"])):
        out = _cli(command, "--help")
        assert out.returncode == 0
        text = " ".join(out.stdout.split())
        for word in words:
            assert word in text, (command, word)


# -- durability ------------------------------------------------------------------------------
@pytest.mark.slow
def test_s3_log_survives_down_and_up(tmp_path):
    stack = EmbeddedStack(tmp_path, StackPorts.free(), storage="s3", die_with_parent=True)
    values = [os.urandom(8) + i.to_bytes(4, "big") for i in range(50)]
    try:
        bootstrap = stack.up().endpoints["kafka_bootstrap"]
        _produce(bootstrap, "durable", values)
        stack.down()
        # Restart on other ports: the log lives in the bucket, not in the broker process.
        stack = EmbeddedStack(tmp_path, StackPorts.free(), storage="s3", die_with_parent=True)
        bootstrap = stack.up().endpoints["kafka_bootstrap"]
        assert _consume_all(bootstrap, "durable", len(values)) == values
    finally:
        stack.down()


def test_filer_store_is_leveldb3_for_a_new_state_dir_and_leveldb2_kept_for_an_old_one(tmp_path):
    """A new state dir's filer keeps the broker's bucket in a leveldb of its own (leveldb3: its deletion
    markers are compacted away, docs/results.md); a state dir whose filer was leveldb2 (weed's default,
    what AstraFlow used before) keeps that store, and so its log, across a down and an up."""
    new = tmp_path / "new"
    stack = EmbeddedStack(new, StackPorts.free(), storage="s3", die_with_parent=True)
    try:
        _produce(stack.up().endpoints["kafka_bootstrap"], "fresh", [b"x"])
    finally:
        stack.down()
    assert (new / "seaweedfs" / "filerldb3" / "tansu").is_dir()
    assert not (new / "seaweedfs" / "filerldb2").exists()
    assert "[leveldb3]" in (new / "filer.toml").read_text()

    old = tmp_path / "old"
    (old / "seaweedfs" / "filerldb2").mkdir(parents=True)
    values = [os.urandom(8) + i.to_bytes(4, "big") for i in range(20)]
    stack = EmbeddedStack(old, StackPorts.free(), storage="s3", die_with_parent=True)
    try:
        _produce(stack.up().endpoints["kafka_bootstrap"], "kept", values)
        stack.down()
        stack = EmbeddedStack(old, StackPorts.free(), storage="s3", die_with_parent=True)
        assert _consume_all(stack.up().endpoints["kafka_bootstrap"], "kept", len(values)) == values
    finally:
        stack.down()
    assert list((old / "seaweedfs" / "filerldb2").iterdir())  # leveldb2 wrote its files there
    assert not (old / "seaweedfs" / "filerldb3").exists()


@pytest.mark.parametrize("old", [False, True], ids=["new volume", "leveldb2 volume"])
def test_weed_launch_writes_the_filer_store_rule_into_the_data_dir_and_starts_weed_there(tmp_path, old):
    """Compose's seaweedfs service starts weed through astraflow.embedded.weed_launch: the same store rule as
    the embedded stack (leveldb3 new, leveldb2 kept), weed started in the data dir with its arguments."""
    data = tmp_path / "data"
    if old:
        (data / "filerldb2").mkdir(parents=True)
    weed = tmp_path / "weed"
    weed.write_text('#!/bin/sh\necho "cwd=$(pwd)"\necho "args=$*"\ncat filer.toml\n')
    weed.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "astraflow.embedded.weed_launch", "mini", f"-dir={data}", "-s3.port=1"],
                         capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "ASTRAFLOW_WEED_BIN": str(weed)}).stdout
    store = "leveldb2" if old else "leveldb3"
    assert f"cwd={data.resolve()}" in out and f"args=mini -dir={data} -s3.port=1" in out, out
    assert f"[{store}]" in out and str(data.resolve() / FILER_STORE_DIRS[store]) in out, out
    bad = subprocess.run([sys.executable, "-m", "astraflow.embedded.weed_launch", "mini"], capture_output=True,
                         text=True, timeout=60, check=False, env={**os.environ, "ASTRAFLOW_WEED_BIN": str(weed)})
    assert bad.returncode != 0 and "names no data dir" in bad.stderr, bad.stderr


@pytest.mark.slow
# kafka-python's producer retries its flush in __del__ after the broker is gone.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_broker_kill9_gives_clear_client_errors_and_keeps_acknowledged_records(tmp_path):
    stack = EmbeddedStack(tmp_path, StackPorts.free(), storage="s3", die_with_parent=True)
    values = [f"acked-{i}".encode() for i in range(20)]
    try:
        bootstrap = stack.up().endpoints["kafka_bootstrap"]
        _produce(bootstrap, "crash", values)
        producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all", max_block_ms=2000,
                                 request_timeout_ms=2000, delivery_timeout_ms=3000, retries=1)

        stack.kafka.kill()  # kill -9

        # A bounded wait always ends in a KafkaError. kafka-python's idempotent producer does not
        # always expire the record itself after delivery_timeout_ms (its sender can sit retrying
        # the producer-id request), so callers must bound their waits, as here.
        with pytest.raises(KafkaError):
            producer.send("crash", value=b"lost").get(timeout=20)
        with contextlib.suppress(KafkaError):  # close() flushes, and the flush times out too
            producer.close(timeout=1)
        with pytest.raises(KafkaError, match=f"bootstrap.*{bootstrap}"):  # names the address
            KafkaConsumer(bootstrap_servers=[bootstrap], bootstrap_timeout_ms=2000)

        status = _cli("status", "--state-dir", str(tmp_path))
        assert status.returncode == 1 and "partly running" in " ".join(status.stdout.split())

        again = stack.up()  # restarts the dead broker (and the rest)
        assert not again.already_running
        consumed = _consume_all(again.endpoints["kafka_bootstrap"], "crash", len(values))
        assert consumed[: len(values)] == values
    finally:
        stack.down()


def test_log_storage_default_is_durable_unless_told(monkeypatch):
    from astraflow.embedded.tansu import default_log_storage

    monkeypatch.delenv("ASTRAFLOW_LOG_STORAGE", raising=False)
    assert default_log_storage() == "s3"
    assert EmbeddedStack("/nonexistent").storage == "s3"
    monkeypatch.setenv("ASTRAFLOW_LOG_STORAGE", "memory")
    assert default_log_storage() == "memory"
    monkeypatch.setenv("ASTRAFLOW_LOG_STORAGE", "postgres")
    with pytest.raises(ValueError, match="ASTRAFLOW_LOG_STORAGE must be one of s3, memory"):
        default_log_storage()
    with pytest.raises(StackError, match="log storage must be one of"):
        EmbeddedStack("/nonexistent", storage="disk")


@pytest.mark.slow
def test_default_up_keeps_the_log_across_down_crash_and_up(tmp_path):
    """``astraflow up`` with no storage option: the durable log. Records come back after a down/up
    and after a crash of both servers (SIGKILL, stale pid files: what a reboot leaves); nothing
    listens beyond loopback; down leaves no process."""
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k != "ASTRAFLOW_LOG_STORAGE"}
    ports = free_block_plan()

    def up() -> tuple[dict, list[int]]:
        out = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "up", "--state-dir", str(state),
                              *_port_args(ports)], capture_output=True, text=True, timeout=120, check=False,
                             env={**env, "COLUMNS": "200"})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "lost at" not in out.stdout  # no memory-storage warning
        pids = [json.loads((state / f"{name}.pid").read_text())["pid"] for name in ("tansu", "seaweedfs")]
        return json.loads((state / "stack.json").read_text()), pids

    values = [os.urandom(8) + i.to_bytes(4, "big") for i in range(30)]
    stack, pids = up()
    try:
        assert stack["log_storage"] == "s3"
        listening = [addr for pid in pids for addr in _listening_addresses(pid)]
        assert listening and all(addr.startswith("127.0.0.1:") for addr in listening), listening
        _produce(stack["kafka_bootstrap"], "kept", values)

        down = _cli("down", "--state-dir", str(state))
        assert down.returncode == 0 and "Data kept" in down.stdout, down.stdout + down.stderr
        assert not any(pid_alive(pid) for pid in pids)
        stack, pids = up()
        assert _consume_all(stack["kafka_bootstrap"], "kept", len(values)) == values

        # A crash: both servers SIGKILLed, pid files and stack.json left behind.
        crashed = EmbeddedStack(state)
        crashed.kafka.kill()
        crashed.s3.kill()
        assert (state / "stack.json").exists()
        stack, pids = up()
        assert _consume_all(stack["kafka_bootstrap"], "kept", len(values)) == values
    finally:
        down = _cli("down", "--state-dir", str(state))
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(pid_alive(pid) for pid in pids)
    assert not _our_listeners(ports, state)


@pytest.mark.slow
def test_a_run_stack_keeps_its_log_for_the_next_run(tmp_path, monkeypatch):
    """The stack ``astraflow run`` starts when nothing is configured (``open_cluster``): durable by
    default, so a second run on the same state dir (``--run-id`` of a stopped run) finds the
    records of the first; ``log_storage="memory"`` is the explicit opt-out."""
    from astraflow.launcher import open_cluster

    monkeypatch.delenv("ASTRAFLOW_LOG_STORAGE", raising=False)
    for name in [n for n in os.environ if n.startswith("ASTRAFLOW_")]:
        monkeypatch.delenv(name)
    values = [f"record-{i}".encode() for i in range(20)]
    cfg = ClusterConfig(state_dir=tmp_path / "state")
    with open_cluster(cfg, announce=lambda _: None) as resolved:
        assert json.loads((tmp_path / "state" / "stack.json").read_text())["log_storage"] == "s3"
        _produce(resolved.kafka.bootstrap, "run.tasks", values)
    assert not (tmp_path / "state" / "stack.json").exists()  # stopped with the run
    with open_cluster(cfg, announce=lambda _: None) as resolved:
        assert _consume_all(resolved.kafka.bootstrap, "run.tasks", len(values)) == values

    mem = ClusterConfig(state_dir=tmp_path / "mem")
    with open_cluster(mem, log_storage="memory", announce=lambda _: None) as resolved:
        assert json.loads((tmp_path / "mem" / "stack.json").read_text())["log_storage"] == "memory"
