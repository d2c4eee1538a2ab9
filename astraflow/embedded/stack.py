"""The embedded stack: a real S3 server (SeaweedFS) and a real Kafka broker (Tansu) on loopback.

``up`` starts SeaweedFS, then Tansu (whose durable log lives in SeaweedFS's ``tansu`` bucket),
waits until both answer, and writes ``stack.json`` (the contract read by
:meth:`astraflow.config.ClusterConfig.resolve`). ``down`` stops Tansu first (so that it is not left
writing into a vanished S3), then SeaweedFS, and removes ``stack.json``.

``secure=True`` (``astraflow up --secure``, docs/security.md) keeps both servers on loopback ports of
their own and puts stunnel (:mod:`astraflow.embedded.stunnel`) on the public ports: the log with mutual
TLS, the bucket with HTTPS and one S3 identity per role, from the CA and credentials generated under
``<state_dir>/secure/`` (:mod:`astraflow.security.material`). ``stack.json`` then names the operator's
credential file instead of holding keys.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from astraflow.config import STACK_FILE
from astraflow.embedded.ports import LOOPBACK, StackPorts, port_is_free
from astraflow.embedded.seaweedfs import s3_answers, weed_argv, weed_env, write_filer_config
from astraflow.embedded.stunnel import find_stunnel_bin, stack_tunnels, stunnel_conf
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
from astraflow.security.material import SecureMaterial, write_private

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
        secure: bool = False,
        bind_host: str = LOOPBACK,
        advertise_host: str | None = None,
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
        self.secure = secure
        """TLS on the public ports (stunnel), role identities on the bucket (see the module doc)."""
        self.bind_host = bind_host
        """Address the public listeners of a secured stack bind (``0.0.0.0``: every interface)."""
        self.advertise_host = advertise_host or (bind_host if bind_host != "0.0.0.0" else LOOPBACK)
        """Host name clients reach the public listeners by (in ``stack.json`` and the server certificate)."""
        self.tls = SupervisedProcess("stunnel", self.state_dir)
        self._backend = self.ports
        """The servers' own ports: the public ones, or loopback ones behind stunnel when secure."""

    @classmethod
    def start_private(
        cls,
        state_dir: str | Path,
        *,
        ports: StackPorts | None = None,
        storage: LogStorage = "memory",
        attempts: int = 3,
        secure: bool = False,
    ) -> tuple[EmbeddedStack, UpResult]:
        """Start a stack owned by the calling process (tests, benchmarks, a run): it dies with the
        caller even on SIGKILL; the caller stops it with :meth:`down`. On ``ports`` if given, else
        on free random ones. A port is checked free, then bound by the server a moment later, and
        another process (a teammate's test run) may take it in between: a failed start is retried
        on a fresh random plan, ``attempts`` times in all."""
        for attempt in range(attempts):
            stack = cls(state_dir, ports or StackPorts.free(), storage=storage, die_with_parent=True, secure=secure)
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
    def admin_keys(self) -> tuple[str, str]:
        """The S3 key pair the stack itself uses (bucket creation, the broker's s3 log): the state
        dir's one key, or a secured stack's ``admin`` identity."""
        if self.secure:
            keys = SecureMaterial(self.state_dir).s3_keys()["admin"]
            return keys["access_key"], keys["secret_key"]
        return self.credentials()

    def running_endpoints(self) -> dict | None:
        """``stack.json`` if every service of a previous ``up`` is alive, else None."""
        if not self.stack_file.exists() or not (self.s3.alive() and self.kafka.alive()):
            return None
        endpoints = json.loads(self.stack_file.read_text())
        if endpoints.get("credentials_file") and not self.tls.alive():
            return None
        return endpoints

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
        material = SecureMaterial(self.state_dir)
        try:
            if self.secure:
                material.ensure([self.advertise_host, LOOPBACK, "localhost"], DATA_BUCKET, TANSU_BUCKET)
                kafka_backend, s3_backend = _free_ports(self.ports, 2)
                self._backend = self.ports.model_copy(update={"kafka": kafka_backend, "s3": s3_backend})
            seconds["s3"] = self.start_service(self.s3.name)
            if self.secure:  # before the broker, whose clients are told to come through it
                seconds["tls"] = self.start_service(self.tls.name)
            seconds["kafka"] = self.start_service(self.kafka.name)
        except Exception as exc:
            self.down()
            if isinstance(exc, StackError):
                raise
            raise StackError(f"embedded stack failed to start: {exc}") from exc

        endpoints = {
            "kafka_bootstrap": self.kafka_bootstrap,
            "s3_endpoint": self.s3_endpoint,
            "s3_master": f"http://{LOOPBACK}:{self.ports.master}",
            "s3_filer": f"http://{LOOPBACK}:{self.ports.filer}",
            "s3_bucket": DATA_BUCKET,
            "log_storage": self.storage,
            "ports": self.ports.by_service(),
            "started_at": time.time(),
        }
        if self.secure:
            endpoints["credentials_file"] = str(material.credentials_file("admin"))
            endpoints["backend_ports"] = {"kafka": self._backend.kafka, "s3": self._backend.s3}
        else:
            endpoints["s3_access_key"], endpoints["s3_secret_key"] = self.credentials()
        tmp = self.stack_file.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(endpoints, f, indent=2)
        tmp.replace(self.stack_file)
        return UpResult(already_running=False, endpoints=endpoints, seconds=seconds)

    @property
    def kafka_bootstrap(self) -> str:
        """What clients bootstrap from (the TLS listener of a secured stack)."""
        return f"{self.advertise_host if self.secure else LOOPBACK}:{self.ports.kafka}"

    @property
    def s3_endpoint(self) -> str:
        return f"https://{self.advertise_host}:{self.ports.s3}" if self.secure else f"http://{LOOPBACK}:{self.ports.s3}"

    def start_service(self, name: str) -> float:
        """Start ``seaweedfs``, ``tansu`` or (secured) ``stunnel`` on this stack's ports and log storage
        and wait until it answers; returns the seconds taken. ``up`` starts them with it; the
        supervisor of a run that owns the stack calls it again for a server that died (S3 first: a
        durable log lives in it)."""
        access, secret = self.admin_keys()
        backend_s3 = f"http://{LOOPBACK}:{self._backend.s3}"
        material = SecureMaterial(self.state_dir)
        t0 = time.monotonic()
        if name == self.s3.name:
            buckets = [DATA_BUCKET, TANSU_BUCKET]
            data_dir = self.state_dir / "seaweedfs"
            data_dir.mkdir(parents=True, exist_ok=True)
            write_filer_config(self.state_dir, data_dir)
            argv = weed_argv(data_dir, self._backend, buckets)
            if self.secure:  # the admin identity comes from the identities file with the others
                argv.append(f"-s3.config={material.identities_file}")
            self.s3.spawn(argv, weed_env(None if self.secure else (access, secret)),
                          cwd=self.state_dir, die_with_parent=self.die_with_parent)
            self.s3.wait_until(lambda: s3_answers(backend_s3, access, secret, buckets),
                               self.start_timeout_s, f"S3 on {backend_s3}")
        elif name == self.kafka.name:
            self.kafka.spawn(tansu_argv(self._backend.kafka, self.storage, advertised=self.kafka_bootstrap),
                             tansu_env(self.storage, backend_s3, access, secret),
                             cwd=self.state_dir, die_with_parent=self.die_with_parent)
            tls = material.client_tls("admin") if self.secure else {}
            self.kafka.wait_until(lambda: kafka_answers(self.kafka_bootstrap, **tls), self.start_timeout_s,
                                  f"Kafka on {self.kafka_bootstrap}")
        elif name == self.tls.name and self.secure:
            tunnels = stack_tunnels(bind_host=self.bind_host, kafka_port=self.ports.kafka,
                                    kafka_backend=self._backend.kafka, s3_port=self.ports.s3,
                                    s3_backend=self._backend.s3)
            conf = write_private(material.dir / "stunnel.conf", stunnel_conf(
                tunnels, cert_file=material.server_cert_file, key_file=material.server_key_file,
                ca_file=material.ca_file))
            self.tls.spawn([find_stunnel_bin(), str(conf)], cwd=self.state_dir, die_with_parent=self.die_with_parent)
            self.tls.wait_until(lambda: s3_answers(self.s3_endpoint, access, secret, [], ca_file=str(material.ca_file)),
                                self.start_timeout_s, f"TLS on {self.s3_endpoint}")
        else:
            raise StackError(f"no service {name!r} in the embedded stack")
        return round(time.monotonic() - t0, 3)

    def scope_trainers(self, policies: list[str], timeout_s: float = 30.0) -> list[str]:
        """A trainer identity per policy on this running secured stack (``trainer-<policy>``, writing that
        policy's versions and checkpoints only), created where missing: the S3 server reads its identities
        file again on SIGHUP, and this waits until it takes the new keys. Returns the identities added."""
        material = SecureMaterial(self.state_dir)
        added = material.ensure_policy_trainers(policies, DATA_BUCKET, TANSU_BUCKET)
        if not added:
            return []
        pid = self.s3.pid()
        if pid is None or not self.stack_file.exists():
            raise StackError(f"no secured stack runs under {self.state_dir}: `astraflow up --secure` first")
        os.kill(pid, signal.SIGHUP)
        endpoint = json.loads(self.stack_file.read_text())["s3_endpoint"]
        keys = material.s3_keys()
        for identity in added:
            self.s3.wait_until(lambda identity=identity: s3_answers(
                endpoint, keys[identity]["access_key"], keys[identity]["secret_key"], [],
                ca_file=str(material.ca_file)), timeout_s, f"S3 with {identity}'s key")
        return added

    def down(self, timeout_s: float = 10.0) -> list[str]:
        """Stop Tansu, then SeaweedFS; remove ``stack.json``. Returns the names of stopped services."""
        self.stack_file.unlink(missing_ok=True)
        stopped = []
        for proc in (self.tls, self.kafka, self.s3):
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
        if recorded.get("credentials_file"):
            pid = self.tls.pid()
            rows.append(ServiceStatus(service="tls (stunnel)", pid=pid, endpoint=f"{kafka_ep}, {s3_ep}",
                                      alive=pid is not None))
        return rows


def _free_ports(plan: StackPorts, count: int) -> list[int]:
    """``count`` free loopback ports outside ``plan``, for the servers behind the TLS terminator."""
    taken = set(plan.by_service().values())
    ports = [port for port in StackPorts.free().by_service().values() if port not in taken and port_is_free(port)]
    if len(ports) < count:
        raise StackError("no free loopback port for a server behind the TLS terminator")
    return ports[:count]


def _describe(service: str) -> str:
    return {
        "kafka": "Kafka broker (Tansu)",
        "s3": "S3 API (SeaweedFS)",
    }.get(service, f"SeaweedFS {service.replace('_', ' ')}")
