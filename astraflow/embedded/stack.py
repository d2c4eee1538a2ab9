"""The embedded stack: a real S3 server (SeaweedFS) and a real Kafka broker (Tansu) on loopback.

``up`` starts SeaweedFS, then Tansu (whose durable log lives in SeaweedFS's ``tansu`` bucket),
waits until both answer, and writes ``stack.json`` (the contract read by
:meth:`astraflow.config.ClusterConfig.resolve`). ``down`` stops Tansu first (so that it is not left
writing into a vanished S3), then SeaweedFS, and removes ``stack.json``.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from astraflow.config import STACK_FILE
from astraflow.embedded.ports import LOOPBACK, StackPorts
from astraflow.embedded.seaweedfs import s3_answers, weed_argv, weed_env
from astraflow.embedded.supervisor import SupervisedProcess
from astraflow.embedded.tansu import (
    DEFAULT_LOG_STORAGE,
    LOG_STORAGES,
    LogStorage,
    kafka_answers,
    tansu_argv,
    tansu_env,
)
from astraflow.log.trim import TANSU_BUCKET

CREDENTIALS_FILE = "s3-credentials.json"
DATA_BUCKET = "astraflow"


class StackError(RuntimeError):
    """The embedded stack cannot start (a taken port, a missing binary, a process that died)."""


@dataclass(frozen=True)
class ServiceStatus:
    service: str
    pid: int | None
    endpoint: str
    alive: bool


@dataclass(frozen=True)
class UpResult:
    already_running: bool
    endpoints: dict
    """The ``stack.json`` contents."""
    seconds: dict
    """Start-up time per service (empty when already running)."""


class EmbeddedStack:
    """SeaweedFS + Tansu under ``state_dir`` (data, logs, pid files, credentials, ``stack.json``)."""

    def __init__(
        self,
        state_dir: str | Path,
        ports: StackPorts | None = None,
        storage: LogStorage = DEFAULT_LOG_STORAGE,
        die_with_parent: bool = False,
        start_timeout_s: float = 60.0,
    ) -> None:
        if storage not in LOG_STORAGES:
            raise StackError(f"log storage must be one of {', '.join(LOG_STORAGES)}, not {storage!r}")
        self.state_dir = Path(state_dir).absolute()
        self.ports = ports or StackPorts()
        self.storage: LogStorage = storage
        self.die_with_parent = die_with_parent
        """Test fixtures set this so that the servers die with the test process even on SIGKILL."""
        self.start_timeout_s = start_timeout_s
        self.s3 = SupervisedProcess("seaweedfs", self.state_dir)
        self.kafka = SupervisedProcess("tansu", self.state_dir)

    @classmethod
    def start_private(
        cls,
        state_dir: str | Path,
        *,
        ports: StackPorts | None = None,
        storage: LogStorage = "memory",
        attempts: int = 3,
    ) -> tuple[EmbeddedStack, UpResult]:
        """Start a stack owned by the calling process (tests, benchmarks, a run): it dies with the
        caller even on SIGKILL; the caller stops it with :meth:`down`. On ``ports`` if given, else
        on free random ones. A port is checked free, then bound by the server a moment later, and
        another process (a teammate's test run) may take it in between: a failed start is retried
        on a fresh random plan, ``attempts`` times in all."""
        for attempt in range(attempts):
            stack = cls(state_dir, ports or StackPorts.free(), storage=storage, die_with_parent=True)
            try:
                return stack, stack.up()
            except StackError:
                if attempt == attempts - 1:
                    raise
                ports = None
        raise StackError(f"attempts must be at least 1, not {attempts}")

    @property
    def stack_file(self) -> Path:
        return self.state_dir / STACK_FILE

    # -- credentials -------------------------------------------------------------------------
    def credentials(self) -> tuple[str, str]:
        """The S3 key pair of this state dir, generated on first use and kept (0600) thereafter:
        the data in SeaweedFS outlives any one ``up``."""
        path = self.state_dir / CREDENTIALS_FILE
        if path.exists():
            data = json.loads(path.read_text())
            return data["access_key"], data["secret_key"]
        self.state_dir.mkdir(parents=True, exist_ok=True)
        access, secret = "AF" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"access_key": access, "secret_key": secret}, f)
        return access, secret

    # -- lifecycle ---------------------------------------------------------------------------
    def running_endpoints(self) -> dict | None:
        """``stack.json`` if both services of a previous ``up`` are alive, else None."""
        if not self.stack_file.exists() or not (self.s3.alive() and self.kafka.alive()):
            return None
        return json.loads(self.stack_file.read_text())

    def up(self) -> UpResult:
        """Start both services and wait until they answer; harmless if already running."""
        running = self.running_endpoints()
        if running is not None:
            return UpResult(already_running=True, endpoints=running, seconds={})
        stopped = self.down()  # leftovers of a crashed stack (one process alive, stale pid files)

        taken = self.ports.taken()
        deadline = time.monotonic() + (5.0 if stopped else 0.0)
        while taken and time.monotonic() < deadline:
            # Our own just-stopped servers' sockets may take a moment to go.
            time.sleep(0.2)
            taken = self.ports.taken()
        if taken:
            names = ", ".join(f"{port} ({_describe(service)})" for service, port in taken.items())
            raise StackError(
                f"cannot start the embedded stack: port {names} already in use by another process. "
                "Stop it, or pick other ports (astraflow up --kafka-port/--s3-port, "
                "ASTRAFLOW_KAFKA_PORT/ASTRAFLOW_S3_PORT)."
            )

        seconds: dict[str, float] = {}
        try:
            seconds["s3"] = self.start_service(self.s3.name)
            seconds["kafka"] = self.start_service(self.kafka.name)
        except Exception as exc:
            self.down()
            if isinstance(exc, StackError):
                raise
            raise StackError(f"embedded stack failed to start: {exc}") from exc

        access, secret = self.credentials()
        s3_endpoint = f"http://{LOOPBACK}:{self.ports.s3}"
        bootstrap = f"{LOOPBACK}:{self.ports.kafka}"
        endpoints = {
            "kafka_bootstrap": bootstrap,
            "s3_endpoint": s3_endpoint,
            "s3_master": f"http://{LOOPBACK}:{self.ports.master}",
            "s3_access_key": access,
            "s3_secret_key": secret,
            "s3_bucket": DATA_BUCKET,
            "log_storage": self.storage,
            "ports": self.ports.by_service(),
            "started_at": time.time(),
        }
        tmp = self.stack_file.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(endpoints, f, indent=2)
        tmp.replace(self.stack_file)
        return UpResult(already_running=False, endpoints=endpoints, seconds=seconds)

    def start_service(self, name: str) -> float:
        """Start ``seaweedfs`` or ``tansu`` on this stack's ports and log storage and wait until it
        answers; returns the seconds taken. ``up`` starts both with it; the supervisor of a run that
        owns the stack calls it again for a server that died (S3 first: a durable log lives in it)."""
        access, secret = self.credentials()
        s3_endpoint = f"http://{LOOPBACK}:{self.ports.s3}"
        t0 = time.monotonic()
        if name == self.s3.name:
            buckets = [DATA_BUCKET, TANSU_BUCKET]
            data_dir = self.state_dir / "seaweedfs"
            data_dir.mkdir(parents=True, exist_ok=True)
            self.s3.spawn(weed_argv(data_dir, self.ports, buckets), weed_env(access, secret),
                          cwd=self.state_dir, die_with_parent=self.die_with_parent)
            self.s3.wait_until(lambda: s3_answers(s3_endpoint, access, secret, buckets),
                               self.start_timeout_s, f"S3 on {s3_endpoint}")
        elif name == self.kafka.name:
            bootstrap = f"{LOOPBACK}:{self.ports.kafka}"
            self.kafka.spawn(tansu_argv(self.ports.kafka, self.storage),
                             tansu_env(self.storage, s3_endpoint, access, secret),
                             cwd=self.state_dir, die_with_parent=self.die_with_parent)
            self.kafka.wait_until(lambda: kafka_answers(bootstrap), self.start_timeout_s, f"Kafka on {bootstrap}")
        else:
            raise StackError(f"no service {name!r} in the embedded stack")
        return round(time.monotonic() - t0, 3)

    def down(self, timeout_s: float = 10.0) -> list[str]:
        """Stop Tansu, then SeaweedFS; remove ``stack.json``. Returns the names of stopped services."""
        self.stack_file.unlink(missing_ok=True)
        stopped = []
        for proc in (self.kafka, self.s3):
            if proc.stop(timeout_s):
                stopped.append(proc.name)
        return stopped

    def status(self) -> list[ServiceStatus]:
        """One row per service, from the pid files and ``stack.json`` (or the port plan)."""
        recorded = {}
        if self.stack_file.exists():
            recorded = json.loads(self.stack_file.read_text())
        kafka_ep = recorded.get("kafka_bootstrap", f"{LOOPBACK}:{self.ports.kafka}")
        s3_ep = recorded.get("s3_endpoint", f"http://{LOOPBACK}:{self.ports.s3}")
        storage = recorded.get("log_storage", self.storage)
        rows = []
        for name, proc, endpoint in (
            (f"kafka (tansu, log in {storage})", self.kafka, kafka_ep),
            ("s3 (seaweedfs)", self.s3, s3_ep),
        ):
            pid = proc.pid()
            rows.append(ServiceStatus(service=name, pid=pid, endpoint=endpoint, alive=pid is not None))
        return rows


def _describe(service: str) -> str:
    return {
        "kafka": "Kafka broker (Tansu)",
        "s3": "S3 API (SeaweedFS)",
    }.get(service, f"SeaweedFS {service.replace('_', ' ')}")
