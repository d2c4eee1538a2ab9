"""What every manifest of ``astraflow deploy k8s`` is built with: the options, object names, labels and the
pod template shared by every component of one run (:mod:`astraflow.deploy.k8s` renders the run's
components with it, :mod:`astraflow.deploy.trainer_group` a multi-rank trainer)."""

from __future__ import annotations

import hashlib
import math
import re
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from astraflow.config import ClusterConfig, ConfigError
from astraflow.launcher.restarts import RestartPolicy
from astraflow.launcher.runner import RunOptions

if TYPE_CHECKING:
    from astraflow.recipe import PoolSpec

Manifest = dict[str, Any]
CONFIG_DIR = "/etc/astraflow"
MODEL_CACHE = "/var/cache/astraflow/models"
SECRET_FIELDS = {"kafka": ("sasl_username", "sasl_password"), "s3": ("access_key", "secret_key"),
                 "region": ("access_key", "secret_key")}
"""Cluster-config fields that go to the Secret (as ``ASTRAFLOW_<SECTION>_<FIELD>``), not the ConfigMap."""
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
CREDENTIAL_DIR = "/etc/astraflow-credential"
"""Where a pod finds a role's credential (``astraflow credentials issue``) when the Secret carries one."""
CREDENTIAL_FILES = {"credential.yaml": None, "ca.pem": "ssl_cafile", "client.pem": "ssl_certfile",
                    "client.key": "ssl_keyfile"}
"""The files of a credential's Secret: the credential itself (what the pods mount), and its PEMs apart
(the Kafka field each comes from) for the KEDA scaler, which reads the log with the same certificate."""
POD_UID = 10001
"""infra/Dockerfile's user, which every pod runs as."""


class K8sOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: str = "astraflow:local"
    """Container image with AstraFlow, the recipe and what it names (``infra/Dockerfile`` builds one)."""
    recipe_path: str
    """The recipe's path inside the image (relative to its working directory, ``/app``)."""
    namespace: str | None = None
    """Namespace of every object (``None``: the one ``kubectl`` applies to)."""
    archive: bool = True
    """Deploy the archiver (Parquet of the run's log under ``<run>/archive/``), as ``astraflow run`` does."""
    stop_grace_s: float = Field(default=RunOptions.grace_s, ge=0)
    """Seconds between SIGTERM and SIGKILL beyond a node's drain time (the launcher's ``--grace``)."""
    prometheus_port: int = Field(default=9400, ge=0, le=65535)
    """Port of each component's Prometheus ``/metrics`` (``ASTRAFLOW_PROMETHEUS_PORT``), declared as the
    container's ``metrics`` port and in the pod's ``prometheus.io/*`` annotations; 0: no endpoint."""
    trainer_ranks_per_pod: int = Field(default=1, ge=1)
    """Ranks of a multi-rank trainer (``trainer.ranks`` > 1) per pod: one torch.distributed.run agent
    per pod starts this many workers (a machine's GPUs); ``trainer.ranks`` must be a multiple."""


def k8s_name(*parts: str) -> str:
    """A DNS-1123 label of at most 63 characters from a run id and component parts (``Math_1`` +
    ``raas`` -> ``math-1-raas``); a longer one is cut and ends with a hash of the whole."""
    name = "-".join(re.sub(r"[^a-z0-9-]+", "-", p.lower()).strip("-") for p in parts)
    if len(name) > 63:
        name = f"{name[:54].rstrip('-')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    if not _DNS_LABEL.match(name):
        raise ConfigError(f"Kubernetes name {name!r} (from {'/'.join(parts)}) is not a DNS label")
    return name


class Kit:
    """Object names, labels and the pod template shared by every component of one run."""

    def __init__(self, run: str, opts: K8sOptions, credential: bool = False) -> None:
        self.run, self.opts = run, opts
        self.prefix = k8s_name("astraflow", run)
        self.credential = credential
        """The cluster config is a role's credential file: the Secret carries the file, which every pod
        mounts (``ASTRAFLOW_CREDENTIALS_FILE``), instead of ``ASTRAFLOW_*`` variables."""

    def name(self, *parts: str) -> str:
        return k8s_name(self.prefix, *parts)

    def labels(self, component: str) -> dict[str, str]:
        """``component`` is the launcher's name for it (dataflow, trainer-<policy>, raas-<pool>, archive)."""
        return {"app.kubernetes.io/name": "astraflow", "app.kubernetes.io/instance": self.prefix,
                "app.kubernetes.io/component": component}

    def obj(self, api: str, kind: str, name: str, component: str, spec: dict[str, Any], field: str = "spec"
            ) -> Manifest:
        meta: dict[str, Any] = {"name": name, "labels": self.labels(component)}
        if self.opts.namespace:
            meta["namespace"] = self.opts.namespace
        return {"apiVersion": api, "kind": kind, "metadata": meta, field: spec}

    def config_map(self, cfg: ClusterConfig) -> Manifest:
        exclude: dict[str, Any] = {"state_dir": True, **{s: set(f) for s, f in SECRET_FIELDS.items()}}
        if self.credential:  # endpoints, TLS and keys come with the credential, read under this at load
            exclude.update({"kafka": True, "s3": True, "role": True, "credentials_file": True,
                            "role_credentials_dir": True})
        data = cfg.model_dump(mode="json", exclude_none=True, exclude=exclude)
        text = yaml.safe_dump(data, sort_keys=False)
        return self.obj("v1", "ConfigMap", self.name("cluster"), "config", {"cluster.yaml": text},
                        field="data")

    def secret(self, cfg: ClusterConfig) -> Manifest:
        values = {}
        for section, fields in SECRET_FIELDS.items():
            settings = getattr(cfg, section)
            for field in fields:
                if settings is not None and getattr(settings, field):
                    values[f"ASTRAFLOW_{section.upper()}_{field.upper()}"] = getattr(settings, field)
        out = self.obj("v1", "Secret", self.name("credentials"), "config", values, field="stringData")
        out["type"] = "Opaque"
        return out

    def credential_secret(self, cfg: ClusterConfig) -> Manifest:
        """The Secret of a role's credential file (``cfg.credentials_file``), its bytes as they are, and its
        PEMs apart for KEDA; base64 ``data``, so that a PEM's lines reach the pod unchanged."""
        import base64
        from pathlib import Path

        if cfg.credentials_file is None or not cfg.kafka.ssl_certfile:
            raise ConfigError("a credential's Secret needs the credential file and its client certificate")
        files = {name: Path(cfg.credentials_file if field is None else getattr(cfg.kafka, field)).read_bytes()
                 for name, field in CREDENTIAL_FILES.items()}
        out = self.obj("v1", "Secret", self.name("credentials"), "config",
                       {name: base64.b64encode(data).decode() for name, data in files.items()}, field="data")
        out["type"] = "Opaque"
        return out

    def trigger_auth(self) -> Manifest:
        if self.credential:  # KEDA reads the lag with the role's certificate (tls itself is the trigger's)
            refs = [{"parameter": p, "name": self.name("credentials"), "key": key}
                    for p, key in (("ca", "ca.pem"), ("cert", "client.pem"), ("key", "client.key"))]
            return self.obj("keda.sh/v1alpha1", "TriggerAuthentication", self.name("kafka"), "config",
                            {"secretTargetRef": refs})
        refs = [{"parameter": p, "name": self.name("credentials"), "key": f"ASTRAFLOW_KAFKA_SASL_{p.upper()}"}
                for p in ("username", "password")]
        return self.obj("keda.sh/v1alpha1", "TriggerAuthentication", self.name("kafka"), "config",
                        {"secretTargetRef": refs})

    def pod(self, component: str, args: list[str], *, restart: str = "Always", grace_s: float | None = None,
            env: list[dict[str, Any]] | None = None, command: list[str] | None = None,
            resources: dict[str, Any] | None = None, shm: bool = False) -> dict[str, Any]:
        """``command`` (default ``astraflow``) and ``resources`` are the main container's; ``shm``: a
        memory-backed ``/dev/shm`` for it (the container runtime's default is 64 MiB)."""
        def container(name: str, argv: list[str], extra: list[dict[str, Any]],
                      cmd: list[str] | None = None) -> dict[str, Any]:
            out = {"name": name, "image": self.opts.image, "imagePullPolicy": "IfNotPresent",
                   "command": cmd or ["astraflow"], "args": argv,
                   "env": [{"name": "ASTRAFLOW_CONFIG", "value": f"{CONFIG_DIR}/cluster.yaml"},
                           {"name": "ASTRAFLOW_MODEL_CACHE", "value": MODEL_CACHE}, *extra],
                   "envFrom": [{"secretRef": {"name": self.name("credentials")}}],
                   "volumeMounts": [{"name": "cluster-config", "mountPath": CONFIG_DIR, "readOnly": True},
                                    {"name": "model-cache", "mountPath": MODEL_CACHE}],
                   "securityContext": {"allowPrivilegeEscalation": False}}
            if self.credential:
                del out["envFrom"]
                out["env"].append({"name": "ASTRAFLOW_CREDENTIALS_FILE",
                                   "value": f"{CREDENTIAL_DIR}/credential.yaml"})
                out["volumeMounts"].append({"name": "credential", "mountPath": CREDENTIAL_DIR, "readOnly": True})
            return out

        topics = ["deploy", "topics", "--recipe", self.opts.recipe_path]
        port = self.opts.prometheus_port
        metrics_env = [{"name": "ASTRAFLOW_PROMETHEUS_PORT", "value": str(port)}] if port else []
        main = container(component.split("-")[0], args, [*(env or []), *metrics_env], command)
        if port:
            main["ports"] = [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
        volumes = [{"name": "cluster-config", "configMap": {"name": self.name("cluster")}},
                   {"name": "model-cache", "emptyDir": {}}]
        pod_security: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": POD_UID}
        if self.credential:
            # The credential file only, readable by the pod's group alone (fsGroup: its user's).
            volumes.append({"name": "credential", "secret": {
                "secretName": self.name("credentials"), "defaultMode": 0o440,
                "items": [{"key": "credential.yaml", "path": "credential.yaml"}]}})
            pod_security["fsGroup"] = POD_UID
        if resources:
            main["resources"] = resources
        if shm:
            main["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
        spec: dict[str, Any] = {
            "restartPolicy": restart,
            "securityContext": pod_security,
            "initContainers": [container("topics", topics, [])],
            "containers": [main],
            "volumes": volumes,
            "terminationGracePeriodSeconds": math.ceil(self.opts.stop_grace_s if grace_s is None
                                                       else grace_s),
        }
        metadata: dict[str, Any] = {"labels": self.labels(component)}
        if port:
            metadata["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                       "prometheus.io/path": "/metrics"}
        return {"metadata": metadata, "spec": spec}

    def deployment(self, component: str, pod: dict[str, Any], **spec: Any) -> Manifest:
        body = {**spec, "selector": {"matchLabels": self.labels(component)}, "template": pod}
        return self.obj("apps/v1", "Deployment", self.name(component), component, body)

    def singleton(self, component: str, args: list[str]) -> Manifest:
        """One replica, the old one gone before the new one starts (one group member, one task emitter)."""
        return self.deployment(component, self.pod(component, args), replicas=1,
                               strategy={"type": "Recreate"})

    def trainer(self, policy: str) -> Manifest:
        component = f"trainer-{policy}"
        pod = self.pod(component, ["trainer", "--recipe", self.opts.recipe_path, "--policy", policy],
                       restart="OnFailure")
        return self.obj("batch/v1", "Job", self.name(component), component,
                        {"backoffLimit": RestartPolicy().max_restarts, "template": pod})

    def pool(self, pool: PoolSpec) -> Manifest:
        """No ``replicas``: the ScaledObject owns the count (re-applying the file does not reset it)."""
        component = f"raas-{pool.name}"
        pod = self.pod(component, ["raas", "--recipe", self.opts.recipe_path, "--pool", pool.name,
                                   "--node-id", "$(POD_NAME)"],
                       grace_s=pool.drain_timeout_s + self.opts.stop_grace_s,
                       env=[{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}])
        return self.deployment(component, pod)
