"""``astraflow deploy k8s``: manifests valid for Kubernetes and KEDA, running the launcher's components,
scaling each pool on the topic and consumer group its nodes really use.

Built-in kinds are validated by ``kubernetes-validate`` (the API's own schemas, strict: an unknown
field is an error); KEDA's ``ScaledObject`` / ``TriggerAuthentication`` against the openAPIV3Schema of
KEDA's CRDs (vendored in tests/data/keda/, made strict the same way).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, latest_version

from astraflow.cli.main import build_parser, main
from astraflow.config import ClusterConfig, ConfigError
from astraflow.deploy.k8s import HEADER, K8sOptions, kafka_trigger, render
from astraflow.deploy.trainer_group import RENDEZVOUS_PORT, TORCHRUN
from astraflow.launcher.plan import component_specs, run_topics
from astraflow.log import ConsumerGroups, LogConsumer, Topics
from astraflow.recipe import PoolAutoscale, Recipe

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CLUSTER = ROOT / "infra" / "k8s" / "cluster.example.yaml"
EXAMPLE_OUT = ROOT / "infra" / "k8s" / "math"
KEDA_CRDS = Path(__file__).parent / "data" / "keda"
K8S_VERSIONS = (all_versions()[0], latest_version())
"""The oldest and the newest Kubernetes API the validator knows."""


def _cluster(**kafka) -> ClusterConfig:
    cfg = ClusterConfig.load(EXAMPLE_CLUSTER, env={})
    return cfg.model_copy(update={"kafka": cfg.kafka.model_copy(update=kafka)})


def _autoscaled(recipe: Recipe) -> Recipe:
    pools = [recipe.pools[0].model_copy(update={"autoscale": PoolAutoscale(min_nodes=1, max_nodes=6,
                                                                            cooldown_s=90)}),
             *recipe.pools[1:]]
    return recipe.model_copy(update={"pools": pools})


def _ranked(recipe: Recipe, ranks: int, device: str) -> Recipe:
    """``recipe`` with a ``ranks``-rank trainer whose backend trains on ``device``."""
    policies = [p.model_copy(update={"backend": p.backend.model_copy(update={"device": device})})
                for p in recipe.policies]
    return recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"ranks": ranks}),
                                     "policies": policies})


def _variants() -> dict[str, tuple[Recipe, ClusterConfig]]:
    math = Recipe.load(ROOT / "examples" / "recipes" / "math.yaml")
    hetero = Recipe.load(ROOT / "examples" / "recipes" / "sim_hetero.yaml")
    sasl = _cluster(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="rl-trainer",
                    sasl_password="kafka-secret")
    return {
        "math": (math, _cluster().model_copy(update={"run": "math"})),
        "hetero-autoscaled-sasl": (_autoscaled(hetero), sasl.model_copy(update={"run": "Sim_Hetero.2"})),
        "math-4-ranks-cuda": (_ranked(math, 4, "cuda"), _cluster().model_copy(update={"run": "math-4"})),
    }


VARIANTS = _variants()
OPTIONS = {"math-4-ranks-cuda": {"trainer_ranks_per_pod": 2}}
"""K8sOptions of a variant beyond the recipe path and namespace."""


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request) -> tuple[Recipe, ClusterConfig, dict[str, list[dict]]]:
    recipe, cfg = VARIANTS[request.param]
    opts = K8sOptions(recipe_path="examples/recipes/x.yaml", namespace="rl", **OPTIONS.get(request.param, {}))
    return recipe.model_copy(update={"run": cfg.run}), cfg, render(recipe, cfg, opts)


def _docs(files: dict[str, list[dict]], kind: str | None = None) -> list[dict]:
    return [d for docs in files.values() for d in docs if kind is None or d["kind"] == kind]


def _strict(schema):
    """Like ``kubectl apply --validate=strict``: a field the schema does not name is an error (the API
    server would drop it silently), unless the schema keeps unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "properties" else _strict(v)) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: _strict(s) for name, s in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def _keda_validator(kind: str) -> jsonschema.Draft4Validator:
    files = {"ScaledObject": "keda.sh_scaledobjects.yaml",
             "TriggerAuthentication": "keda.sh_triggerauthentications.yaml"}
    crd = yaml.safe_load((KEDA_CRDS / files[kind]).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def _validate_builtin(doc: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# -- validity --------------------------------------------------------------------------------------

def test_builtin_objects_validate_against_the_kubernetes_api(rendered):
    recipe, _cfg, files = rendered
    builtin = [d for d in _docs(files) if not d["apiVersion"].startswith("keda.sh/")]
    group = {"Service"} if recipe.trainer.ranks > 1 else set()  # the trainer ranks' headless Service
    assert {d["kind"] for d in builtin} == {"ConfigMap", "Secret", "Deployment", "Job"} | group
    for doc in builtin:
        _validate_builtin(doc)
        assert doc["metadata"]["namespace"] == "rl"


def test_keda_objects_validate_against_the_keda_crds(rendered):
    _recipe, cfg, files = rendered
    keda = [d for d in _docs(files) if d["apiVersion"].startswith("keda.sh/")]
    sasl = {"TriggerAuthentication"} if cfg.kafka.sasl_mechanism else set()
    assert {d["kind"] for d in keda} == {"ScaledObject"} | sasl
    for doc in keda:
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        _keda_validator(doc["kind"]).validate(doc)


def test_the_validators_refuse_a_misspelt_field():
    recipe, cfg = VARIANTS["math"]
    files = render(recipe, cfg, K8sOptions(recipe_path="examples/recipes/math.yaml"))
    scaled = _docs(files, "ScaledObject")[0]
    bad = {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}}
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        _keda_validator("ScaledObject").validate(bad)
    bad = {**scaled, "spec": {**scaled["spec"], "minReplicaCount": "one"}}
    with pytest.raises(jsonschema.ValidationError, match="one"):
        _keda_validator("ScaledObject").validate(bad)
    deployment = _docs(files, "Deployment")[0]
    with pytest.raises(kubernetes_validate.ValidationError, match="strategie"):
        _validate_builtin({**deployment, "spec": {**deployment["spec"], "strategie": {"type": "Recreate"}}})


def test_names_fit_kubernetes_and_are_unique(rendered):
    _recipe, _cfg, files = rendered
    names = [(d["kind"], d["metadata"]["name"]) for d in _docs(files)]
    assert len(set(names)) == len(names)
    # A run id Kubernetes would refuse as a name is mapped (Sim_Hetero.2 -> sim-hetero-2), a long one cut.
    long_run = "a-very-long-run-id-for-a-sweep-over-learning-rates-and-staleness-0007"
    recipe, cfg = VARIANTS["math"]
    files = render(recipe, cfg.model_copy(update={"run": long_run}), K8sOptions(recipe_path="r.yaml"))
    for doc in _docs(files):
        assert len(doc["metadata"]["name"]) <= 63
        if doc["kind"] != "ConfigMap" and doc["kind"] != "Secret" and doc["kind"] != "ScaledObject":
            _validate_builtin(doc)


# -- the KEDA trigger names what the code uses ----------------------------------------------------

def test_each_pool_scales_on_its_task_topic_and_consumer_group(rendered):
    recipe, cfg, files = rendered
    deployments = {d["metadata"]["name"]: d for d in _docs(files, "Deployment")}
    scaled = _docs(files, "ScaledObject")
    assert len(scaled) == len(recipe.pools)
    partitions = run_topics(recipe, cfg.run)
    for pool, obj in zip(recipe.pools, scaled, strict=True):
        (trigger,) = obj["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "kafka"
        # The names the node joins with (astraflow/raas/node.py) and the dataflow emits to.
        assert meta["topic"] == Topics(cfg.run).tasks(pool.name) == f"{cfg.run}.tasks.{pool.name}"
        group = ConsumerGroups(cfg.run).raas(pool.name)
        assert meta["consumerGroup"] == group == f"{cfg.run}.raas.{pool.name}"
        assert trigger == {**kafka_trigger(cfg, pool), **({"authenticationRef": trigger["authenticationRef"]}
                                                          if "authenticationRef" in trigger else {})}
        assert meta["bootstrapServers"] == cfg.kafka.bootstrap
        # A group without commits starts where the node's consumer starts.
        node_start = inspect.signature(LogConsumer).parameters["auto_offset_reset"].default
        assert meta["offsetResetPolicy"] == node_start
        assert int(meta["lagThreshold"]) == pool.concurrency
        # The target is this pool's Deployment, and never more nodes than its task topic has partitions.
        target = deployments[obj["spec"]["scaleTargetRef"]["name"]]
        args = target["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--pool") + 1] == pool.name
        assert "replicas" not in target["spec"]  # KEDA owns the count
        lo, hi = obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]
        task_partitions = partitions[Topics(cfg.run).tasks(pool.name)]
        if pool.autoscale is not None:
            assert (lo, hi) == (pool.autoscale.min_nodes, pool.autoscale.max_nodes)
            behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
            assert behavior["scaleDown"]["stabilizationWindowSeconds"] == pool.autoscale.cooldown_s
        else:
            assert (lo, hi) == (pool.nodes, task_partitions)
        assert hi <= task_partitions
        # SIGTERM drains the node for up to drain_timeout_s before the kubelet's SIGKILL.
        grace = target["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= pool.drain_timeout_s + 1


def test_sasl_kafka_authenticates_the_trigger_from_the_secret():
    recipe, cfg = VARIANTS["hetero-autoscaled-sasl"]
    files = render(recipe, cfg, K8sOptions(recipe_path="r.yaml"))
    (auth,) = _docs(files, "TriggerAuthentication")
    (secret,) = _docs(files, "Secret")
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert {p: secret["stringData"][r["key"]] for p, r in refs.items()} == {"username": "rl-trainer",
                                                                           "password": "kafka-secret"}
    assert all(r["name"] == secret["metadata"]["name"] for r in refs.values())
    for obj in _docs(files, "ScaledObject"):
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}
        assert (trigger["metadata"]["sasl"], trigger["metadata"]["tls"]) == ("scram_sha512", "enable")


# -- the pods run the launcher's components with the same cluster config ----------------------------

def _component(argv: list[str]) -> tuple[str, str | None]:
    """(command, pool or policy) of an ``astraflow`` command line, or of the workers of a
    torch.distributed.run command line (``... --module astraflow.cli.main ARGS``)."""
    if "--module" in argv:
        argv = argv[argv.index("--module") + 2:]
    args = build_parser().parse_args(argv)
    return args.command, getattr(args, "pool", None) or getattr(args, "policy", None)


def test_pods_run_the_components_the_launcher_starts(rendered, tmp_path):
    recipe, _cfg, files = rendered
    specs = component_specs(recipe, tmp_path / "r.yaml", tmp_path / "c.yaml", tmp_path)
    launched = {_component(s.argv[s.argv.index("--config") + 2:]) for s in specs}
    deployed = set()
    for doc in _docs(files, "Deployment") + _docs(files, "Job"):
        pod = doc["spec"]["template"]["spec"]
        (init,), (main_container,) = pod["initContainers"], pod["containers"]
        assert init["args"][:2] == ["deploy", "topics"] and _component(init["args"])[0] == "deploy"
        for c in (init, main_container):
            assert c["command"] == (TORCHRUN if c is main_container and recipe.trainer.ranks > 1
                                    and doc["kind"] == "Job" else ["astraflow"])
            assert {"name": "ASTRAFLOW_CONFIG", "value": "/etc/astraflow/cluster.yaml"} in c["env"]
        deployed.add(_component(main_container["args"]))
        # A rank group's pod is never restarted in place: its group restarts together (below).
        expect_restart = ("Never" if recipe.trainer.ranks > 1 else "OnFailure") if doc["kind"] == "Job" else "Always"
        assert pod["restartPolicy"] == expect_restart
    assert deployed == launched
    # Labelled with the launcher's names (its nodes raas-<pool>-<i> are one Deployment per pool).
    labels = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in _docs(files, "Deployment")
              + _docs(files, "Job")}
    assert labels == {s.name.rsplit("-", 1)[0] if s.name.startswith("raas-") else s.name for s in specs}


def test_the_cluster_config_reaches_the_pods_whole_credentials_only_by_the_secret(rendered, tmp_path):
    _recipe, cfg, files = rendered
    (config_map,) = _docs(files, "ConfigMap")
    (secret,) = _docs(files, "Secret")
    path = tmp_path / "cluster.yaml"
    path.write_text(config_map["data"]["cluster.yaml"])
    loaded = ClusterConfig.load(path, env=secret["stringData"])
    assert loaded.model_dump(exclude={"state_dir"}) == cfg.model_dump(exclude={"state_dir"})
    assert loaded.run == cfg.run and "run" in loaded.model_fields_set  # the components take this run id
    for value in secret["stringData"].values():
        assert value not in config_map["data"]["cluster.yaml"]


def test_refuses_what_a_cluster_cannot_run():
    recipe, _cfg = VARIANTS["math"]
    opts = K8sOptions(recipe_path="r.yaml")
    with pytest.raises(ConfigError, match="kafka.bootstrap and s3.endpoint"):
        render(recipe, ClusterConfig(), opts)
    with pytest.raises(ConfigError, match="ssl_cafile"):
        render(recipe, _cluster(security_protocol="SSL", ssl_cafile="/etc/ca.pem"), opts)
    with pytest.raises(ConfigError, match="sasl_username"):
        render(recipe, _cluster(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN"), opts)


# -- the CLI and the checked-in example -----------------------------------------------------------

def test_checked_in_example_is_what_the_cli_renders(tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("ASTRAFLOW_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "k8s"
    out.mkdir()
    (out / "raas-gone.yaml").write_text(HEADER + "kind: Deployment\n")  # a pool an earlier rendering had
    (out / "mine.yaml").write_text("kind: ConfigMap\n")  # not rendered by us: kept
    assert main(["--config", str(EXAMPLE_CLUSTER.relative_to(ROOT)), "deploy", "k8s",
                 "examples/recipes/math.yaml", "--out", str(out)]) == 0
    rendered = {p.name: p.read_text() for p in out.glob("*.yaml") if p.name != "mine.yaml"}
    checked_in = {p.name: p.read_text() for p in EXAMPLE_OUT.glob("*.yaml")}
    assert rendered == checked_in, "infra/k8s/math/ is stale: render it again (see docs/scale.md#kubernetes)"
    assert (out / "mine.yaml").exists()


@pytest.mark.integration
def test_deploy_topics_creates_the_topics_with_the_launchers_partitions(test_cluster, tmp_path, monkeypatch):
    from astraflow.launcher.plan import write_recipe
    from astraflow.log.admin import open_admin

    recipe = _autoscaled(Recipe.load(ROOT / "examples" / "recipes" / "sim_hetero.yaml"))
    path = write_recipe(recipe, tmp_path / "recipe.yaml")  # model paths made absolute by Recipe.load
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(test_cluster.model_dump(mode="json")))
    for key in [k for k in os.environ if k.startswith("ASTRAFLOW_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("ASTRAFLOW_CONFIG", str(cluster))
    for _ in range(2):  # idempotent
        assert main(["deploy", "topics", "--recipe", str(path)]) == 0
    expected = run_topics(recipe, test_cluster.run)
    assert expected[Topics(test_cluster.run).tasks("fast")] == 6
    admin = open_admin(test_cluster, 10.0)
    try:
        described = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(sorted(expected))}
    finally:
        admin.close()
    assert described == expected


# -- a multi-rank trainer: an Indexed Job of torch.distributed.run agents and its headless Service -----

def _trainer_group(ranks: int = 4, per_pod: int = 2, device: str = "cpu") -> tuple[dict, dict, Recipe, ClusterConfig]:
    recipe, cfg = VARIANTS["math"]
    recipe = _ranked(recipe, ranks, device)
    files = render(recipe, cfg, K8sOptions(recipe_path="examples/recipes/math.yaml", trainer_ranks_per_pod=per_pod))
    (service, job) = files["trainer-policy.yaml"]
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    return service, job, recipe, cfg


def test_a_multi_rank_trainer_is_an_indexed_job_whose_agents_meet_at_pod_0():
    from astraflow.launcher.restarts import RestartPolicy
    from astraflow.trainer.launch import rank_group_argv

    service, job, _recipe, cfg = _trainer_group(ranks=4, per_pod=2)
    for doc in (service, job):
        _validate_builtin(doc)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    # Every failed pod counts: a group restart fails both pods.
    assert spec["backoffLimit"] == RestartPolicy().max_restarts * 2 and pod["restartPolicy"] == "Never"
    # Pod i of an Indexed Job is <job>-<i>; as the Service's subdomain it is <job>-<i>.<service>.
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    (container,) = pod["containers"]
    argv = container["command"] + container["args"]
    endpoint = f"{job['metadata']['name']}-0.{service['metadata']['name']}:{RENDEZVOUS_PORT}"
    assert [p["port"] for p in service["spec"]["ports"]] == [RENDEZVOUS_PORT]
    # The launcher's own torch.distributed.run command, with the rendezvous of 2 agents of 2 workers.
    worker = ["trainer", "--recipe", "examples/recipes/math.yaml", "--policy", "policy"]
    assert argv == rank_group_argv(worker, 2, nnodes=2, rdzv_endpoint=endpoint, rdzv_id=f"{cfg.run}-policy",
                                   python="python")
    assert argv[argv.index("--max-restarts") + 1] == "0" and argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert _component(container["args"]) == ("trainer", "policy")
    assert "resources" not in container  # a CPU backend asks for no GPU
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_a_cuda_trainer_asks_for_its_ranks_gpus_and_one_pod_per_machine():
    _service, job, _recipe, _cfg = _trainer_group(ranks=8, per_pod=4, device="cuda")
    _validate_builtin(job)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 4}}
    assert job["spec"]["completions"] == 2
    argv = container["args"]
    assert argv[argv.index("--nproc-per-node") + 1] == "4" and argv[argv.index("--nnodes") + 1] == "2"


def test_the_trainer_group_refuses_a_misspelt_field_and_an_uneven_split():
    service, job, _recipe, _cfg = _trainer_group()
    with pytest.raises(kubernetes_validate.ValidationError, match="completionMod"):
        _validate_builtin({**job, "spec": {**job["spec"], "completionMod": "Indexed"}})
    with pytest.raises(kubernetes_validate.ValidationError, match="clusterIp"):
        _validate_builtin({**service, "spec": {**service["spec"], "clusterIp": "None"}})
    template = job["spec"]["template"]
    bad_pod = {**template, "spec": {**template["spec"], "subDomain": "x"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="subDomain"):
        _validate_builtin({**job, "spec": {**job["spec"], "template": bad_pod}})
    with pytest.raises(ConfigError, match="not a multiple of 3 ranks per pod"):
        _trainer_group(ranks=4, per_pod=3)


def test_every_component_pod_serves_and_annotates_prometheus_metrics(rendered):
    _recipe, _cfg, files = rendered
    for doc in _docs(files, "Deployment") + _docs(files, "Job"):
        pod = doc["spec"]["template"]
        (main_container,) = pod["spec"]["containers"]
        assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400",
                                                  "prometheus.io/path": "/metrics"}, doc["metadata"]["name"]
        assert {"name": "ASTRAFLOW_PROMETHEUS_PORT", "value": "9400"} in main_container["env"]
        assert main_container["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]


# -- a role's credential file as the cluster config (nodes of another cluster joining a secured run) ----

def _node_credential(tmp_path: Path, identity: str = "node") -> tuple[Path, ClusterConfig]:
    """``astraflow credentials issue node``'s file (or ``identity``'s) for a secured stack at trainer.example.org."""
    from astraflow.security.material import SecureMaterial

    material = SecureMaterial(tmp_path / "stack")
    material.ensure(["trainer.example.org"], "astraflow", "tansu")
    if identity.startswith("trainer-"):
        material.ensure_policy_trainers([identity.removeprefix("trainer-")], "astraflow", "tansu")
    data = material.credential_file(identity, "trainer.example.org:9093", "https://trainer.example.org:8443",
                                    "astraflow", 100)
    path = tmp_path / f"{identity}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = ClusterConfig.load(path, env={"ASTRAFLOW_STATE_DIR": str(tmp_path / "local")})
    return path, cfg.model_copy(update={"run": "math"})


def test_a_node_credential_renders_the_pools_only_with_the_file_in_a_secret_that_every_pod_mounts(tmp_path):
    import base64

    path, cfg = _node_credential(tmp_path)
    recipe, _ = VARIANTS["math"]
    files = render(recipe, cfg, K8sOptions(recipe_path="r.yaml", namespace="rl"))
    assert set(files) == {"cluster.yaml", "credentials.yaml"} | {f"raas-{p.name}.yaml" for p in recipe.pools}
    for doc in _docs(files):
        (_keda_validator(doc["kind"]).validate if doc["apiVersion"].startswith("keda.sh/") else _validate_builtin)(doc)

    # The Secret carries the file as it is, and its PEMs apart, base64.
    (secret,) = _docs(files, "Secret")
    carried = {name: base64.b64decode(value) for name, value in secret["data"].items()}
    assert carried["credential.yaml"] == path.read_bytes()
    assert carried["ca.pem"] == Path(cfg.kafka.ssl_cafile).read_bytes()
    assert carried["client.key"] == Path(cfg.kafka.ssl_keyfile).read_bytes()
    assert b"PRIVATE KEY" in carried["client.key"] and b"CERTIFICATE" in carried["client.pem"]

    # Every pod mounts the credential file (and nothing else of the Secret) and names it; no variable of it.
    (config_map,) = _docs(files, "ConfigMap")
    for doc in _docs(files, "Deployment"):
        pod = doc["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "credential"]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert volume["secret"]["items"] == [{"key": "credential.yaml", "path": "credential.yaml"}]
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
        for container in pod["initContainers"] + pod["containers"]:
            assert "envFrom" not in container
            assert {"name": "credential", "mountPath": "/etc/astraflow-credential", "readOnly": True} in container["volumeMounts"]
            assert {"name": "ASTRAFLOW_CREDENTIALS_FILE", "value": "/etc/astraflow-credential/credential.yaml"} in container["env"]
    # KEDA reads the lag over TLS with the node's certificate, from the same Secret.
    (auth,) = _docs(files, "TriggerAuthentication")
    assert {r["parameter"]: r["key"] for r in auth["spec"]["secretTargetRef"]} == {"ca": "ca.pem", "cert": "client.pem",
                                                                                   "key": "client.key"}
    for obj in _docs(files, "ScaledObject"):
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["metadata"]["tls"] == "enable" and trigger["authenticationRef"]["name"] == auth["metadata"]["name"]

    # A pod's config (the ConfigMap, the mounted file under it) is the node's; no secret outside the Secret.
    pod_dir = tmp_path / "pod"
    pod_dir.mkdir()
    (pod_dir / "cluster.yaml").write_text(config_map["data"]["cluster.yaml"])
    (pod_dir / "credential.yaml").write_bytes(carried["credential.yaml"])
    loaded = ClusterConfig.load(pod_dir / "cluster.yaml", env={
        "ASTRAFLOW_CREDENTIALS_FILE": str(pod_dir / "credential.yaml"), "ASTRAFLOW_STATE_DIR": str(pod_dir / "state")})
    assert (loaded.role, loaded.run) == ("node", "math")
    assert loaded.kafka.bootstrap == cfg.kafka.bootstrap and loaded.s3.model_dump(exclude={"ca_file"}) == cfg.s3.model_dump(
        exclude={"ca_file"})
    elsewhere = yaml.safe_dump_all([d for d in _docs(files) if d["kind"] != "Secret"])
    key_line = carried["client.key"].decode().splitlines()[1]
    for leaked in (cfg.s3.secret_key, cfg.s3.access_key, key_line, str(tmp_path)):
        assert leaked not in elsewhere


def test_deploy_k8s_with_a_credential_file_writes_its_secret_and_refuses_a_role_without_components(tmp_path, monkeypatch,
                                                                                                     capsys):
    for key in [k for k in os.environ if k.startswith("ASTRAFLOW_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("ASTRAFLOW_STATE_DIR", str(tmp_path / "local"))
    monkeypatch.chdir(ROOT)
    path, _ = _node_credential(tmp_path)
    out = tmp_path / "k8s"
    assert main(["--config", str(path), "deploy", "k8s", "examples/recipes/math.yaml", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.yaml")) == ["cluster.yaml", "credentials.yaml", "raas-default.yaml"]
    assert path.read_text().splitlines()[1] not in (out / "cluster.yaml").read_text()
    reader = yaml.safe_load(path.read_text()) | {"role": "reader"}
    (tmp_path / "reader.yaml").write_text(yaml.safe_dump(reader))
    assert main(["--config", str(tmp_path / "reader.yaml"), "deploy", "k8s", "examples/recipes/math.yaml",
                 "--out", str(tmp_path / "k8s2")]) != 0
    assert "a 'reader' credential runs no component" in capsys.readouterr().err
    assert not (tmp_path / "k8s2").exists()


def test_a_policy_trainer_credential_renders_that_policys_trainer_only():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _, cfg = _node_credential(Path(tmp), "trainer-pi")
        hetero, _ = VARIANTS["hetero-autoscaled-sasl"]
        pi = hetero.policies[0].model_copy(update={"name": "pi"})
        recipe = hetero.model_copy(update={"policies": [pi, *hetero.policies[1:]]})
        files = render(recipe, cfg, K8sOptions(recipe_path="r.yaml"))
        assert set(files) == {"cluster.yaml", "credentials.yaml", "trainer-pi.yaml"}
        (job,) = _docs(files, "Job")
        assert job["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--policy", "pi"]
        with pytest.raises(ConfigError, match="no policy 'pi'"):
            render(hetero, cfg, K8sOptions(recipe_path="r.yaml"))
