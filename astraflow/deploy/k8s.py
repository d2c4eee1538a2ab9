"""Kubernetes manifests of one recipe on a cluster with a real Kafka and S3 (``astraflow deploy k8s``).

Every component runs the ``astraflow <component>`` command that ``astraflow run`` starts
(:mod:`astraflow.launcher.plan`), configured by the same cluster config: a ConfigMap holds it without
its credentials, which a Secret passes as the ``ASTRAFLOW_*`` variables the config loader overlays.

* dataflow, archiver: a Deployment of one replica each (``Recreate``: never two at once);
* one trainer per policy: a Job (it exits 0 once its steps are done, which a Deployment would
  restart for ever; a Job restarts it only when it fails, and it resumes from its checkpoint); with
  ``trainer.ranks`` > 1 an Indexed Job of torch.distributed.run agents and a headless Service for
  their rendezvous (:mod:`astraflow.deploy.trainer_group`);
* one Deployment per RaaS pool, scaled by a KEDA ``ScaledObject`` on the consumer-group lag of the
  pool's task topic; topic and group names come from :class:`Topics` / :class:`ConsumerGroups`,
  the code the nodes join with. On SIGTERM a node drains (``drain_timeout_s``), so its pod's grace
  period is that plus the launcher's.

Each pod first creates the run's topics with the launcher's partition counts (``astraflow deploy
topics``, idempotent): a pool's task topic needs as many partitions as the pool may have nodes.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from astraflow.config import ClusterConfig, ConfigError
from astraflow.deploy.trainer_group import trainer_group
from astraflow.launcher.plan import run_topics
from astraflow.launcher.restarts import RestartPolicy
from astraflow.launcher.runner import RunOptions
from astraflow.log import ConsumerGroups, Topics
from astraflow.log.consumer import AUTO_OFFSET_RESET
from astraflow.recipe import PoolSpec, Recipe

Manifest = dict[str, Any]
HEADER = "# Rendered by `astraflow deploy k8s`: change the recipe or the cluster config and render again.\n"
CONFIG_DIR = "/etc/astraflow"
MODEL_CACHE = "/var/cache/astraflow/models"
SECRET_FIELDS = {"kafka": ("sasl_username", "sasl_password"), "s3": ("access_key", "secret_key"),
                 "region": ("access_key", "secret_key")}
"""Cluster-config fields that go to the Secret (as ``ASTRAFLOW_<SECTION>_<FIELD>``), not the ConfigMap."""
KEDA_SASL = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256", "SCRAM-SHA-512": "scram_sha512"}
"""kafka-python's SASL mechanism -> the KEDA kafka scaler's ``sasl``."""
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


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


def render(recipe: Recipe, cfg: ClusterConfig, opts: K8sOptions) -> dict[str, list[Manifest]]:
    """The manifests of ``recipe`` run as ``cfg.run`` on the cluster of ``cfg``, by file name."""
    if cfg.is_embedded:
        raise ConfigError("a cluster deployment needs kafka.bootstrap and s3.endpoint (the cluster config or "
                          "ASTRAFLOW_KAFKA_BOOTSTRAP / ASTRAFLOW_S3_ENDPOINT) reachable from the pods")
    run = cfg.run
    recipe = recipe.model_copy(update={"run": run})
    k = _Kit(run, opts)
    files: dict[str, list[Manifest]] = {
        "cluster.yaml": [k.config_map(cfg), *([k.trigger_auth()] if cfg.kafka.sasl_mechanism else [])],
        "credentials.yaml": [k.secret(cfg)],
        "dataflow.yaml": [k.singleton("dataflow", ["dataflow", "--recipe", opts.recipe_path])],
    }
    for p in recipe.policies:
        files[f"trainer-{p.name}.yaml"] = (trainer_group(k, recipe, p, opts.trainer_ranks_per_pod)
                                           if recipe.trainer.ranks > 1 else [k.trainer(p.name)])
    partitions = run_topics(recipe, run)
    for pool in recipe.pools:
        task_partitions = partitions[Topics(run).tasks(pool.name)]
        files[f"raas-{pool.name}.yaml"] = [k.pool(pool), scaled_object(k, cfg, pool, task_partitions)]
    if opts.archive:
        files["archive.yaml"] = [k.singleton("archive", ["archive", "--recipe", opts.recipe_path])]
    names = Counter((m["kind"], m["metadata"]["name"]) for ms in files.values() for m in ms)
    if twice := sorted(n for n, count in names.items() if count > 1):
        raise ConfigError(f"two objects would be named {twice}: pool or policy names that differ only in "
                          "'_' vs '-' map to the same Kubernetes name")
    return files


def pool_bounds(pool: PoolSpec, partitions: int) -> tuple[int, int]:
    """(min, max) replicas of a pool: its ``autoscale`` bounds, else from its ``nodes`` up to one node
    per partition of its task topic (more nodes than partitions would idle)."""
    if pool.autoscale is not None:
        return pool.autoscale.min_nodes, pool.autoscale.max_nodes
    return pool.nodes, max(pool.nodes, partitions)


def kafka_trigger(cfg: ClusterConfig, pool: PoolSpec) -> dict[str, Any]:
    """The KEDA trigger of ``pool``: the lag of the pool's consumer group on its task topic, one node
    per ``concurrency`` uncommitted tasks. A node commits a task once its trajectories are acknowledged,
    so the lag counts the tasks running as well as those waiting; the dataflow's staleness bound caps
    both. Topic and group come from :class:`Topics` / :class:`ConsumerGroups`, as the node's do."""
    return {"type": "kafka", "metadata": {
        "bootstrapServers": cfg.kafka.bootstrap,
        "topic": Topics(cfg.run).tasks(pool.name),
        "consumerGroup": ConsumerGroups(cfg.run).raas(pool.name),
        "lagThreshold": str(pool.concurrency),
        "offsetResetPolicy": AUTO_OFFSET_RESET,
        **_keda_security(cfg),
    }}


def scaled_object(k: _Kit, cfg: ClusterConfig, pool: PoolSpec, partitions: int) -> Manifest:
    """The pool's Deployment scaled by KEDA on :func:`kafka_trigger` within :func:`pool_bounds`."""
    lo, hi = pool_bounds(pool, partitions)
    trigger = kafka_trigger(cfg, pool)
    if cfg.kafka.sasl_mechanism:
        trigger["authenticationRef"] = {"name": k.name("kafka")}
    spec: dict[str, Any] = {"scaleTargetRef": {"name": k.name("raas", pool.name)},
                            "minReplicaCount": lo, "maxReplicaCount": hi, "triggers": [trigger]}
    if pool.autoscale is not None:
        # Scale down (a drain) only on what the lag said for the whole cooldown (HPA's default: 300 s);
        # scale up at once, as a backlog is real work waiting.
        window = math.ceil(pool.autoscale.cooldown_s)
        spec["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": {
            "scaleDown": {"stabilizationWindowSeconds": window}}}}
    return k.obj("keda.sh/v1alpha1", "ScaledObject", k.name("raas", pool.name), f"raas-{pool.name}", spec)


def _keda_security(cfg: ClusterConfig) -> dict[str, str]:
    kafka = cfg.kafka
    if kafka.ssl_cafile or kafka.ssl_certfile or kafka.ssl_keyfile:
        raise ConfigError("kafka.ssl_cafile / ssl_certfile / ssl_keyfile name local files, which `deploy "
                          "k8s` does not carry into the pods or KEDA: use a CA the image trusts, or add "
                          "them by hand")
    out = {"tls": "enable"} if kafka.security_protocol in ("SSL", "SASL_SSL") else {}
    if kafka.sasl_mechanism:
        if kafka.sasl_mechanism not in KEDA_SASL:
            raise ConfigError(f"kafka.sasl_mechanism {kafka.sasl_mechanism!r}: the KEDA trigger supports "
                              f"{sorted(KEDA_SASL)}")
        if not (kafka.sasl_username and kafka.sasl_password):
            raise ConfigError("kafka.sasl_mechanism is set but kafka.sasl_username / sasl_password are "
                              "not (set them, e.g. ASTRAFLOW_KAFKA_SASL_USERNAME / _PASSWORD): the Secret "
                              "needs them")
        out["sasl"] = KEDA_SASL[kafka.sasl_mechanism]
    return out


class _Kit:
    """Object names, labels and the pod template shared by every component of one run."""

    def __init__(self, run: str, opts: K8sOptions) -> None:
        self.run, self.opts = run, opts
        self.prefix = k8s_name("astraflow", run)

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

    def trigger_auth(self) -> Manifest:
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
            return {"name": name, "image": self.opts.image, "imagePullPolicy": "IfNotPresent",
                    "command": cmd or ["astraflow"], "args": argv,
                    "env": [{"name": "ASTRAFLOW_CONFIG", "value": f"{CONFIG_DIR}/cluster.yaml"},
                            {"name": "ASTRAFLOW_MODEL_CACHE", "value": MODEL_CACHE}, *extra],
                    "envFrom": [{"secretRef": {"name": self.name("credentials")}}],
                    "volumeMounts": [{"name": "cluster-config", "mountPath": CONFIG_DIR, "readOnly": True},
                                     {"name": "model-cache", "mountPath": MODEL_CACHE}],
                    "securityContext": {"allowPrivilegeEscalation": False}}

        topics = ["deploy", "topics", "--recipe", self.opts.recipe_path]
        port = self.opts.prometheus_port
        metrics_env = [{"name": "ASTRAFLOW_PROMETHEUS_PORT", "value": str(port)}] if port else []
        main = container(component.split("-")[0], args, [*(env or []), *metrics_env], command)
        if port:
            main["ports"] = [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
        volumes = [{"name": "cluster-config", "configMap": {"name": self.name("cluster")}},
                   {"name": "model-cache", "emptyDir": {}}]
        if resources:
            main["resources"] = resources
        if shm:
            main["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
        spec: dict[str, Any] = {
            "restartPolicy": restart,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},  # infra/Dockerfile's user
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


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's cluster.yaml) as literal blocks, readable in the file."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                              style="|" if "\n" in s else None))


def dump(docs: list[Manifest]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def write(files: dict[str, list[Manifest]], out: Path) -> list[Path]:
    """Write each file (several documents each); files an earlier rendering left that this one has
    not are removed, so ``kubectl apply -f OUT`` never re-applies a pool or policy that is gone."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.yaml"):
        if old.name not in files and old.read_text().startswith(HEADER):
            old.unlink()
    paths = []
    for name, docs in files.items():
        path = out / name
        path.write_text(HEADER + dump(docs))
        paths.append(path)
    return paths
