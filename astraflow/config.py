"""The cluster config every component takes: where the log and the bucket are, and which run.

Loaded from YAML and/or ``ASTRAFLOW_*`` environment variables (environment wins). When no Kafka
bootstrap or S3 endpoint is configured, :meth:`ClusterConfig.resolve` fills them in from the
embedded stack started by ``astraflow up`` (its ``stack.json`` in the state directory).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

STACK_FILE = "stack.json"


class ConfigError(ValueError):
    """A configuration is invalid or names something that cannot be reached."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LogRetentionSettings(_Section):
    """How much of a run's log is kept (docs/running.md, "Log retention"): a record leaves the log once
    every consumer group of the run that reads its topic (the archiver's, where the run has one, and the
    dataflow's recovery position among them) has committed past it and it is older than ``keep_s``. The
    dataflow trims (the archiver, in a run without a dataflow)."""

    enabled: bool = True
    """Trim the run's topics while it runs. Off: the log keeps every record, and the embedded broker's
    s3 log slows every fetch down as the run ages (its fetches list the partition's whole history)."""
    keep_s: float = Field(default=30.0, ge=0)
    """Every record stays at least this long, whatever the commits say: a margin only. What a restarted
    dataflow reads back is held by its recovery position for as long as it is down."""
    interval_s: float = Field(default=10.0, gt=0)
    """Seconds between two trims."""
    max_held_records: int = Field(default=1_000_000, ge=1)
    """The most records the readers may hold on one partition behind its end (a run's log holds at most
    this many per partition of its topics, whatever its readers do). A reader that lags further (an
    archiver down for hours, a dataflow that never comes back) no longer holds the log: trimming goes
    on up to this far behind the end, and the trimming component says what each reader lost (an error
    line in its log and a ``log-records-dropped`` record on ``<run>.metrics``, which the launcher writes
    to ``metrics.jsonl``). Readers that keep up hold what is in flight; the default is there for one
    that never comes back."""


class KafkaSettings(_Section):
    bootstrap: str | None = None
    """``host:port[,host:port]`` of the Kafka brokers; ``None`` means the embedded Tansu broker."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Passed through to kafka-python."""
    sasl_mechanism: str | None = None
    """PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, ... (with a SASL protocol)."""
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    """CA bundle that signs the brokers' certificates (with an SSL protocol)."""
    ssl_certfile: str | None = None
    """This client's certificate (a secured embedded stack's log authenticates clients by it)."""
    ssl_keyfile: str | None = None
    """The private key of ``ssl_certfile``."""
    ssl_ca_pem: str | None = None
    """``ssl_cafile``'s contents inline (a credential file, ``astraflow credentials issue``): written to a
    0600 file under ``<state_dir>/tls/`` at load, which then fills ``ssl_cafile``."""
    ssl_cert_pem: str | None = None
    """``ssl_certfile``'s contents inline, as ``ssl_ca_pem``."""
    ssl_key_pem: str | None = None
    """``ssl_keyfile``'s contents inline, as ``ssl_ca_pem`` (a secret)."""
    fetch_max_wait_ms: int | None = Field(default=None, ge=1, le=10_000)
    """How long the broker may hold a consumer's fetch that has no new record. Tansu looks again after
    half the time left (at 1/2, 3/4, ... of the wait), so a record waits up to about half of this
    there (``benchmarks/fetch_wait.py``: p50 5 ms and max 13 ms at 20); lower costs more idle fetches
    (each one a bucket listing on Tansu's s3 log). ``None``: 20 ms on an embedded
    in-memory log, 100 ms on the embedded s3 log (``benchmarks/pipeline_overhead.py``), else
    kafka-python's 500 ms (a Kafka broker answers a held fetch as soon as a record arrives)."""

    embedded_log: Literal["s3", "memory"] | None = None
    """The embedded broker's log storage, filled in by :meth:`ClusterConfig.resolve` from the running
    stack (None: another broker). It says how retention trims the log (:mod:`astraflow.log.trim`)."""
    retention: LogRetentionSettings = Field(default_factory=LogRetentionSettings)
    """What of the run's log is kept while it runs."""

    def client_kwargs(self) -> dict[str, Any]:
        """Connection settings as kafka-python keyword arguments (bootstrap must be resolved)."""
        if not self.bootstrap:
            raise ConfigError("Kafka bootstrap is not resolved; call ClusterConfig.resolve() first")
        kw: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap.split(","),
            "security_protocol": self.security_protocol,
        }
        optional = {
            "sasl_mechanism": self.sasl_mechanism,
            "sasl_plain_username": self.sasl_username,
            "sasl_plain_password": self.sasl_password,
            "ssl_cafile": self.ssl_cafile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_keyfile": self.ssl_keyfile,
        }
        kw.update({k: v for k, v in optional.items() if v is not None})
        return kw


EMBEDDED_FETCH_MAX_WAIT_MS = {"memory": 20, "s3": 100}
"""``kafka.fetch_max_wait_ms`` chosen for the embedded broker, per log storage (docs/running.md#latency)."""
KAFKA_FETCH_MAX_WAIT_MS = 500
"""kafka-python's default, kept for any other broker."""
BACKGROUND_FETCH_MAX_WAIT_MS = 250
"""The least fetch wait of a consumer off the pipeline's critical path (the archiver, the launcher's
metrics view): on a shared machine each wake-up of a 20 ms fetch loop takes CPU from the trainer and
the nodes (benchmarks/pipeline_overhead.py: 0.172 -> 0.154 s/step with these two at 250 ms)."""


class S3Settings(_Section):
    endpoint: str | None = None
    """``http(s)://host:port`` of the S3 server; ``None`` means the embedded SeaweedFS (AWS: set it to
    the regional endpoint)."""
    access_key: str | None = None
    secret_key: str | None = None
    ca_file: str | None = None
    """CA bundle to verify an ``https`` endpoint with (``None``: the system's)."""
    ca_pem: str | None = None
    """``ca_file``'s contents inline (a credential file): written under ``<state_dir>/tls/`` at load."""
    region: str = "us-east-1"
    bucket: str = "astraflow"
    """The bucket holding every run's weights, checkpoints, claims and archives."""
    embedded_master: str | None = None
    """The embedded SeaweedFS's master (``http://127.0.0.1:<port>``), filled in by
    :meth:`ClusterConfig.resolve` from the running stack (None: another S3 server). The archiver asks
    it to reclaim deleted objects' disk space (:mod:`astraflow.embedded.vacuum`)."""
    embedded_filer: str | None = None
    """The embedded SeaweedFS's filer (``http://127.0.0.1:<port>``), filled in like ``embedded_master``:
    its metadata log is kept to its last minutes (:mod:`astraflow.embedded.metalog`)."""


class RegionSettings(_Section):
    """A regional replica of the run's bucket that this node reads immutable objects from.

    Weights (manifests, deltas, anchors) and claim-checked payloads are written once and never
    changed, so a copy kept by the object store's own replication (SeaweedFS ``weed filer.sync``, S3
    bucket replication, a mirror tool) serves them as well as the origin does, without crossing the
    region boundary. Everything else stays on the origin (``s3``): writes, listings (the origin says
    what is published) and mutable objects (checkpoint pointers, subscriber registrations). Kafka is
    shared. See docs/scale.md, "Regions".
    """

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Region name, reported with the node's metrics (``eu-west``, ``b``, ...)."""
    s3_endpoint: str
    """``http(s)://host:port`` of the S3 endpoint holding the replica."""
    bucket: str | None = None
    """The replica bucket; ``None``: the origin's name (``s3.bucket``)."""
    access_key: str | None = None
    """Credentials of the replica endpoint; ``None``: the origin's (``s3.access_key``)."""
    secret_key: str | None = None
    s3_region: str | None = None
    """Signing region of the replica endpoint; ``None``: the origin's (``s3.region``)."""
    on_missing: Literal["wait", "origin"] = "wait"
    """An object the origin has but the replica does not yet (an announcement that arrived before
    replication): ``wait`` polls the replica with backoff up to ``max_wait_s``, then the read fails
    as unavailable (the node keeps serving what it has and retries later); ``origin`` reads it from
    the origin bucket at once (bytes crossing the region boundary, counted)."""
    max_wait_s: float = Field(default=30.0, ge=0)
    """Bound of a ``wait`` for one object."""
    backoff_initial_s: float = Field(default=0.05, gt=0)
    """First pause between two looks at the replica while waiting; doubled after each look."""
    backoff_max_s: float = Field(default=1.0, gt=0)
    """Longest pause between two looks at the replica."""


class PrometheusSettings(_Section):
    """Each long-lived component's ``/metrics`` endpoint for Prometheus (``prometheus-client``, the
    ``prometheus`` extra): its latest metrics records as gauges (``astraflow_<record>_<field>``)."""

    port: int = Field(default=0, ge=0, le=65535)
    """Port of the component's ``/metrics``; 0 = no endpoint (the default). One per pod on a cluster;
    ``astraflow run --prometheus`` gives each component of a run a free port of its own."""
    host: str = "0.0.0.0"
    """Address to listen on: all interfaces (a pod's scraper comes from outside it); the launcher
    binds its components to 127.0.0.1."""


class ClusterConfig(_Section):
    run: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run id: prefixes every topic (``<run>.tasks.<pool>``) and every bucket key (``<run>/...``)."""
    state_dir: Path = Path(".astraflow")
    """Where the embedded stack keeps its data, pids and ``stack.json``."""
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    s3: S3Settings = Field(default_factory=S3Settings)
    region: RegionSettings | None = None
    """A regional replica of the bucket to read weights and claim-checked payloads from (``None``:
    everything from ``s3``)."""
    inline_limit_bytes: int = Field(default=900 * 1024, gt=0)
    """Record values above this size go to the bucket and the record carries a pointer (claim
    check). The default stays under the broker's 1 MiB message limit."""
    prometheus: PrometheusSettings = Field(default_factory=PrometheusSettings)
    """The component's Prometheus endpoint (``ASTRAFLOW_PROMETHEUS_PORT`` / ``_HOST``); off by default."""
    role: str | None = None
    """The role whose credential this config carries (``node``, ``trainer``, ..., or ``trainer-<policy>``,
    a trainer of that policy only), set in a credential file (``astraflow credentials issue``); a config
    naming a role is its own ``credentials_file``."""
    credentials_file: Path | None = None
    """A credential file (``ASTRAFLOW_CREDENTIALS_FILE``) whose settings are read under this config's at
    load: the secrets (S3 keys, the TLS client key) stay in it, and a config the launcher writes
    (``runs/<run>/cluster.yaml``) keeps this path instead of their values (docs/security.md)."""
    role_credentials_dir: Path | None = None
    """A folder of credential files named by role (``trainer.yaml``, ``node.yaml``, ...): ``astraflow
    run`` gives each component its own role's (a secured embedded stack's ``secure/credentials/``)."""

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, env: Mapping[str, str] | None = None) -> ClusterConfig:
        """YAML file (``path`` or ``$ASTRAFLOW_CONFIG``), overlaid with ``ASTRAFLOW_*`` variables."""
        env = os.environ if env is None else env
        path = path or env.get("ASTRAFLOW_CONFIG")
        data: dict[str, Any] = {}
        if path:
            data = read_yaml_mapping(Path(path), "cluster config")
            if data.get("role") and not data.get("credentials_file"):
                data["credentials_file"] = str(Path(path).absolute())
        _overlay_env(data, env)
        if data.get("credentials_file"):
            data["credentials_file"] = str(Path(data["credentials_file"]).absolute())  # children's cwd differs
            data = _merged(read_yaml_mapping(Path(data["credentials_file"]), "credential file"), data)
        try:
            return cls.model_validate(data).with_pem_files()
        except ValidationError as exc:
            where = f" in {path}" if path else ""
            raise ConfigError(f"invalid cluster config{where}:\n{exc}") from None

    def with_pem_files(self) -> ClusterConfig:
        """Inline PEMs (``kafka.ssl_*_pem``, ``s3.ca_pem``) written to 0600 files under
        ``<state_dir>/tls/`` (named by their digest) and named by the file fields instead, since the
        TLS libraries read files; the inline values leave the config."""
        kafka = {f"ssl_{kind}file": _pem_file(self.state_dir, pem)
                 for kind, pem in (("ca", self.kafka.ssl_ca_pem), ("cert", self.kafka.ssl_cert_pem),
                                   ("key", self.kafka.ssl_key_pem)) if pem}
        s3 = {"ca_file": _pem_file(self.state_dir, self.s3.ca_pem)} if self.s3.ca_pem else {}
        if not kafka and not s3:
            return self
        kafka.update(ssl_ca_pem=None, ssl_cert_pem=None, ssl_key_pem=None)
        return self.model_copy(update={"kafka": self.kafka.model_copy(update=kafka),
                                       "s3": self.s3.model_copy(update={**s3, "ca_pem": None})})

    @property
    def is_embedded(self) -> bool:
        return self.kafka.bootstrap is None or self.s3.endpoint is None

    def resolve(self) -> ClusterConfig:
        """Fill unset endpoints from the running embedded stack; fail fast if there is none."""
        if not self.is_embedded:
            return self
        stack_file = self.state_dir / STACK_FILE
        if not stack_file.exists():
            missing = [
                name
                for name, value in (
                    ("Kafka bootstrap (kafka.bootstrap / ASTRAFLOW_KAFKA_BOOTSTRAP)", self.kafka.bootstrap),
                    ("S3 endpoint (s3.endpoint / ASTRAFLOW_S3_ENDPOINT)", self.s3.endpoint),
                )
                if value is None
            ]
            raise ConfigError(
                f"no {' and no '.join(missing)} is configured, and no embedded stack runs under "
                f"{self.state_dir} (no {STACK_FILE}): run `astraflow up`, or configure the endpoint"
            )
        stack = json.loads(stack_file.read_text())
        if stack.get("credentials_file") and self.credentials_file is None:
            # A secured stack: its operator credential (TLS client certificate, S3 keys) by reference.
            own = self.model_dump(mode="json", exclude_unset=True)
            creds = read_yaml_mapping(Path(stack["credentials_file"]), "credential file")
            data = _merged(creds, {**own, "credentials_file": stack["credentials_file"],
                                   "role_credentials_dir": str(Path(stack["credentials_file"]).parent)})
            return ClusterConfig.model_validate(data).with_pem_files().resolve()
        kafka_update: dict[str, Any] = {"bootstrap": self.kafka.bootstrap or stack["kafka_bootstrap"]}
        if self.kafka.bootstrap is None:
            storage = stack.get("log_storage", "s3")
            kafka_update["embedded_log"] = storage
            if self.kafka.fetch_max_wait_ms is None:
                kafka_update["fetch_max_wait_ms"] = EMBEDDED_FETCH_MAX_WAIT_MS.get(storage)
        kafka = self.kafka.model_copy(update=kafka_update)
        s3_update = {}
        if self.s3.endpoint is None:
            s3_update = {
                "endpoint": stack["s3_endpoint"],
                "access_key": self.s3.access_key or stack["s3_access_key"],
                "secret_key": self.s3.secret_key or stack["s3_secret_key"],
                "bucket": stack.get("s3_bucket", self.s3.bucket),
                "embedded_master": stack.get("s3_master"),
                "embedded_filer": stack.get("s3_filer"),
            }
        return self.model_copy(update={"kafka": kafka, "s3": self.s3.model_copy(update=s3_update)})


def _merged(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s values in place of its own, section by section."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def _pem_file(state_dir: Path, pem: str) -> str:
    """``pem`` in ``<state_dir>/tls/<digest>.pem`` (directory 0700, file 0600), written once."""
    import hashlib

    folder = Path(state_dir).absolute() / "tls"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / f"{hashlib.sha256(pem.encode()).hexdigest()[:24]}.pem"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(pem)
        tmp.replace(path)
    return str(path)


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """The mapping at the top of a YAML file; ``what`` names the file in errors ("recipe", ...)."""
    if not path.exists():
        raise ConfigError(f"{what} not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping, got {type(data).__name__}")
    return data


def _overlay_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    """``ASTRAFLOW_RUN`` -> run, ``ASTRAFLOW_KAFKA_BOOTSTRAP`` -> kafka.bootstrap, and so on."""
    sections = {"kafka": KafkaSettings, "s3": S3Settings, "region": RegionSettings, "prometheus": PrometheusSettings}
    for field in ClusterConfig.model_fields:
        if field in sections:
            for sub in sections[field].model_fields:
                value = env.get(f"ASTRAFLOW_{field.upper()}_{sub.upper()}")
                if value is not None:
                    data.setdefault(field, {})[sub] = value
        else:
            value = env.get(f"ASTRAFLOW_{field.upper()}")
            if value is not None:
                data[field] = value
