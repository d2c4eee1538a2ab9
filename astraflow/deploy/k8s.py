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

import math
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from astraflow.config import ClusterConfig, ConfigError
from astraflow.deploy.kit import K8sOptions, Kit, Manifest
from astraflow.deploy.trainer_group import trainer_group
from astraflow.launcher.plan import run_topics
from astraflow.log import ConsumerGroups, Topics
from astraflow.log.consumer import AUTO_OFFSET_RESET
from astraflow.recipe import PoolSpec, Recipe
from astraflow.security.roles import POLICY_TRAINER

HEADER = "# Rendered by `astraflow deploy k8s`: change the recipe or the cluster config and render again.\n"
ROLE_COMPONENTS = {"dataflow": "dataflow", "trainer": "trainer", "node": "raas", "archiver": "archive"}
"""A role's credential file as the cluster config (``astraflow --config node.yaml deploy k8s ...``): only
that role's components are rendered, and the Secret carries the file (another machine's or cluster's
nodes joining a secured run, docs/security.md)."""
KEDA_SASL = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256", "SCRAM-SHA-512": "scram_sha512"}
"""kafka-python's SASL mechanism -> the KEDA kafka scaler's ``sasl``."""


def render(recipe: Recipe, cfg: ClusterConfig, opts: K8sOptions) -> dict[str, list[Manifest]]:
    """The manifests of ``recipe`` run as ``cfg.run`` on the cluster of ``cfg``, by file name."""
    if cfg.is_embedded:
        raise ConfigError("a cluster deployment needs kafka.bootstrap and s3.endpoint (the cluster config or "
                          "ASTRAFLOW_KAFKA_BOOTSTRAP / ASTRAFLOW_S3_ENDPOINT) reachable from the pods")
    role, policies = cfg.role, [p.name for p in recipe.policies]
    if role is not None and role.startswith(POLICY_TRAINER):  # one policy's trainer key: that trainer only
        policies = [role.removeprefix(POLICY_TRAINER)]
        if policies[0] not in {p.name for p in recipe.policies}:
            raise ConfigError(f"the credential is {role!r}'s, and the recipe has no policy {policies[0]!r}")
        role = "trainer"
    if role is not None and role not in ROLE_COMPONENTS:
        raise ConfigError(f"a {role!r} credential runs no component: render with a credential of "
                          f"{', '.join(ROLE_COMPONENTS)} (astraflow credentials issue ROLE)")
    run = cfg.run
    recipe = recipe.model_copy(update={"run": run})
    k = Kit(run, opts, credential=role is not None)
    rendered = {ROLE_COMPONENTS[role]} if role else set(ROLE_COMPONENTS.values())
    authenticated = cfg.kafka.sasl_mechanism is not None or k.credential
    files: dict[str, list[Manifest]] = {
        "cluster.yaml": [k.config_map(cfg), *([k.trigger_auth()] if authenticated and "raas" in rendered else [])],
        "credentials.yaml": [k.credential_secret(cfg) if k.credential else k.secret(cfg)],
    }
    if "dataflow" in rendered:  # the dataflow trims the log; without an archiver it waits for no archive group
        files["dataflow.yaml"] = [k.singleton("dataflow", ["dataflow", "--recipe", opts.recipe_path,
                                                           *([] if opts.archive else ["--no-archive"])])]
    for p in [p for p in recipe.policies if p.name in policies] if "trainer" in rendered else []:
        files[f"trainer-{p.name}.yaml"] = (trainer_group(k, recipe, p, opts.trainer_ranks_per_pod)
                                           if recipe.trainer.ranks > 1 else [k.trainer(p.name)])
    partitions = run_topics(recipe, run)
    for pool in recipe.pools if "raas" in rendered else []:
        task_partitions = partitions[Topics(run).tasks(pool.name)]
        files[f"raas-{pool.name}.yaml"] = [k.pool(pool), scaled_object(k, cfg, pool, task_partitions)]
    if opts.archive and "archive" in rendered:
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
        **_keda_security(cfg, from_credential=cfg.role is not None),
    }}


def scaled_object(k: Kit, cfg: ClusterConfig, pool: PoolSpec, partitions: int) -> Manifest:
    """The pool's Deployment scaled by KEDA on :func:`kafka_trigger` within :func:`pool_bounds`."""
    lo, hi = pool_bounds(pool, partitions)
    trigger = kafka_trigger(cfg, pool)
    if cfg.kafka.sasl_mechanism or k.credential:
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


def _keda_security(cfg: ClusterConfig, from_credential: bool = False) -> dict[str, str]:
    """``from_credential``: the ``ssl_*`` files are a credential file's PEMs, which its Secret carries."""
    kafka = cfg.kafka
    if not from_credential and (kafka.ssl_cafile or kafka.ssl_certfile or kafka.ssl_keyfile):
        raise ConfigError("kafka.ssl_cafile / ssl_certfile / ssl_keyfile name local files, which `deploy "
                          "k8s` does not carry into the pods or KEDA: use a CA the image trusts, or add "
                          "them by hand, or render from a role's credential file (astraflow credentials issue)")
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
