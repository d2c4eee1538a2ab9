"""What a run launches: the effective recipe, the cluster file, and one command per component.

Every component is started exactly as a user would start it on another machine
(``astraflow --config CLUSTER <component> --recipe RECIPE ...``), so the launcher exercises the same
path as a remote node. The cluster config travels as a file (``ASTRAFLOW_CONFIG``) and the run id as
``ASTRAFLOW_RUN``; inherited ``ASTRAFLOW_*`` variables are dropped so they cannot override them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from astraflow.config import ClusterConfig
from astraflow.launcher.supervisor import ChildSpec
from astraflow.recipe import Recipe
from astraflow.security.roles import policy_trainer


def effective_recipe(recipe: Recipe, *, run_id: str, steps: int | None = None,
                     nodes: dict[str, int] | None = None) -> Recipe:
    """The recipe with the launcher's overrides applied and every policy's checkpoint resolved to
    a local directory once (a tiny-model spec materialised, a GGUF converted, an ``s3://`` prefix
    downloaded), so the components, which read a copy under ``runs/<run>/``, all load the same files."""
    from astraflow.models import policy_checkpoint_dir

    nodes = nodes or {}
    unknown = set(nodes) - {p.name for p in recipe.pools}
    if unknown:
        raise ValueError(f"--nodes names unknown pools {sorted(unknown)}; the recipe's pools are "
                         f"{[p.name for p in recipe.pools]}")
    pools = [p.model_copy(update={"nodes": nodes.get(p.name, p.nodes)}) for p in recipe.pools]
    policies = [p.model_copy(update={"model": str(policy_checkpoint_dir(recipe, p.name))}) for p in recipe.policies]
    update: dict = {"run": run_id, "pools": pools, "policies": policies}
    if steps is not None:
        update["trainer"] = recipe.trainer.model_copy(update={"steps": steps})
    out = recipe.model_copy(update=update)
    # Re-validate: overrides go through the same checks as the file.
    validated = Recipe.model_validate(out.model_dump())
    validated.source = recipe.source
    return validated


def slot_shortfall(recipe: Recipe) -> str | None:
    """A hint when the pools that receive tasks have fewer episode slots (the launcher's nodes x
    ``concurrency``) than the tasks the dataflow has out at once: async keeps up to ``in_flight_cap``,
    sync a wave of ``groups_per_batch``. The rest wait in the topic for a slot (the math recipe with
    16 slots instead of 32: 2.56x the one-process loop's time per step instead of 1.74x)."""
    flow = recipe.dataflow
    if flow.mode == "async":
        out, why = flow.in_flight_cap, "(max_staleness + 1) x groups_per_batch"
    else:
        out, why = flow.groups_per_batch, "a sync wave"
    receiving = set(flow.route_pools) or {recipe.dataset.pool}
    slots = sum(p.nodes * p.concurrency for p in recipe.pools if p.name in receiving)
    if slots >= out:
        return None
    return (f"pools {sorted(receiving)} have {slots} episode slots (nodes x concurrency) and the dataflow keeps up "
            f"to {out} tasks out ({why}); the rest wait for a slot. Raise concurrency or nodes unless memory "
            f"bounds them (docs/running.md#latency).")


def write_recipe(recipe: Recipe, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    return path


def run_topics(recipe: Recipe, run_id: str) -> dict[str, int]:
    """Every topic of the run with its partition count (created before any component starts)."""
    from astraflow.log import Topics

    # One partition per node at most: an autoscaled pool's last nodes would otherwise idle.
    most = {pool.name: max(pool.nodes, pool.autoscale.max_nodes if pool.autoscale is not None else 0)
            for pool in recipe.pools}
    return Topics(run_id).partitions(most, [policy.name for policy in recipe.policies])


def available_cores() -> int:
    """CPU cores this process may run on (its affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_component(recipe: Recipe, cores: int | None = None) -> int:
    """Torch threads for each component process: the cores shared by the processes that compute
    (each policy's trainer ranks, the pools' nodes), at least one. Two cores and a trainer plus a node
    get one each (oversubscribed OpenMP threads spin on shared cores); sixteen cores give them eight."""
    computing = len(recipe.policies) * recipe.trainer.ranks + sum(pool.nodes for pool in recipe.pools)
    return max(1, (cores or available_cores()) // max(1, computing))


def unavailable_devices(recipe: Recipe) -> list[str]:
    """What the recipe places on a torch device this machine lacks (a ``device`` of a policy's
    backend or a pool's engine: ``cuda`` without a GPU, ``cuda:3`` with two), one line each naming
    the field. Torch is imported only when some device is not ``cpu``."""
    placed = [(f"policies.{i}.backend.device", getattr(p.backend, "device", None))
              for i, p in enumerate(recipe.policies)]
    placed += [(f"pools.{i}.engine.device", getattr(pool.engine, "device", None))
               for i, pool in enumerate(recipe.pools)]
    placed = [(field, device) for field, device in placed if device not in (None, "cpu")]
    if not placed:
        return []
    import torch

    out = []
    for field, device in placed:
        try:
            d = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            out.append(f"{field} {device!r} is not a torch device: {exc}")
            continue
        if d.type != "cuda":
            continue  # mps, xpu, ...: left to torch, which names them
        if not torch.cuda.is_available():
            out.append(f"{field} is {device!r}, but torch {torch.__version__} on this machine sees no CUDA device")
        elif d.index is not None and d.index >= torch.cuda.device_count():
            out.append(f"{field} is {device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
        elif field.startswith("policies.") and recipe.trainer.ranks > torch.cuda.device_count():
            out.append(f"{field} is {device!r} with trainer.ranks {recipe.trainer.ranks} (a device per rank), but "
                       f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    return out


def refuse_unavailable_devices(recipe: Recipe, source: str = "the recipe") -> None:
    """Raise ValueError naming every field of :func:`unavailable_devices` (nothing when there is none)."""
    if missing := unavailable_devices(recipe):
        raise ValueError(f"{source} places models on devices this machine lacks:\n  " + "\n  ".join(missing))


COMPONENT_ROLES = {"dataflow": "dataflow", "trainer": "trainer", "raas": "node", "archive": "archiver",
                   "sinks": "reader"}
"""The role whose credential each component command runs with on a secured cluster (security/roles.py)."""


def child_env(cluster_file: Path, run_id: str, threads: int = 1, credential: Path | None = None) -> dict[str, str]:
    """The environment of a component; ``credential``: its role's credential file, in place of the one
    the cluster file names (least privilege on a secured cluster)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    if credential is not None:
        env["ASTRAFLOW_CREDENTIALS_FILE"] = str(credential)
    env.update({
        "ASTRAFLOW_CONFIG": str(cluster_file),
        "ASTRAFLOW_RUN": run_id,
        "PYTHONUNBUFFERED": "1",
        # threads_per_component: several components share the cores; oversubscribed BLAS threads
        # cost more than they give.
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "ASTRAFLOW_TORCH_THREADS": str(threads),
    })
    return env


def role_credential(credentials_dir: Path | None, command: str, policy: str | None = None) -> Path | None:
    """The credential file of ``command``'s role in ``credentials_dir`` (None: none there); a trainer's
    of its ``policy`` (``trainer-<policy>.yaml``, scoped to that policy's prefixes) where there is one."""
    if credentials_dir is None:
        return None
    if command == "trainer" and policy is not None:
        scoped = Path(credentials_dir) / f"{policy_trainer(policy)}.yaml"
        if scoped.exists():
            return scoped
    path = Path(credentials_dir) / f"{COMPONENT_ROLES[command]}.yaml"
    return path if path.exists() else None


def component_specs(recipe: Recipe, recipe_file: Path, cluster_file: Path, run_dir: Path,
                    *, threads: int = 1, archive: bool = True, rollouts: bool = True,
                    credentials_dir: Path | None = None) -> list[ChildSpec]:
    """Dataflow first, then one trainer per policy, then ``nodes`` RaaS nodes per pool, then (with
    ``archive``) the archiver, which runs until the stop: on SIGTERM it reads what is left on the
    topics, flushes its last Parquet parts and exits 0 within the launcher's grace period. Without
    ``rollouts`` (trainers fed from an archive) no dataflow and no node."""
    base = _cli(cluster_file)

    def env(command: str) -> dict[str, str]:
        return child_env(cluster_file, recipe.run, threads, role_credential(credentials_dir, command))

    logs = run_dir / "logs"
    specs = []
    if rollouts:  # the dataflow trims the log; without an archiver, it waits for no archive group
        specs.append(ChildSpec("dataflow", [*base, "dataflow", "--recipe", str(recipe_file),
                                            *([] if archive else ["--no-archive"])], env("dataflow"),
                               logs / "dataflow.log"))
    for policy in recipe.policies:
        name = f"trainer-{policy.name}"
        trainer_env = child_env(cluster_file, recipe.run, threads,
                                role_credential(credentials_dir, "trainer", policy.name))
        specs.append(ChildSpec(name, trainer_argv(recipe, recipe_file, cluster_file, policy.name), trainer_env,
                               logs / f"{name}.log", may_exit=True))
    for pool in recipe.pools if rollouts else []:
        specs += [node_spec(recipe, recipe_file, cluster_file, run_dir, pool.name, i, threads=threads,
                            credentials_dir=credentials_dir) for i in range(pool.nodes)]
    if archive:  # without a dataflow (trainers fed from an archive), the archiver trims the log
        specs.append(ChildSpec("archive", [*base, "archive", "--recipe", str(recipe_file),
                                           *([] if rollouts else ["--trim-log"])], env("archive"), logs / "archive.log"))
    if recipe.report.any:
        specs.append(ChildSpec("sinks", [*base, "sinks", "--recipe", str(recipe_file)], env("sinks"),
                               logs / "sinks.log"))
    return specs


def trainer_argv(recipe: Recipe, recipe_file: Path, cluster_file: Path, policy: str) -> list[str]:
    """The command of one policy's trainer: ``astraflow trainer``, or with ``trainer.ranks`` > 1 the
    same command as the workers of one torch.distributed.run agent, which the supervisor watches as
    one component (a dead rank ends the agent; the restarted group resumes from its checkpoint)."""
    args = ["trainer", "--recipe", str(recipe_file), "--policy", policy]
    if recipe.trainer.ranks == 1:
        return [*_cli(cluster_file), *args]
    from astraflow.trainer.launch import rank_group_argv

    return rank_group_argv(["--config", str(cluster_file), *args], recipe.trainer.ranks)


def node_name(pool: str, index: int) -> str:
    """The component id (and node id) of a pool's ``index``-th node started by the launcher."""
    return f"raas-{pool}-{index}"


def node_spec(recipe: Recipe, recipe_file: Path, cluster_file: Path, run_dir: Path, pool: str, index: int,
              *, threads: int = 1, credentials_dir: Path | None = None) -> ChildSpec:
    """The command of one RaaS node of ``pool`` (at launch, or started later by the actuator)."""
    name = node_name(pool, index)
    credential = role_credential(credentials_dir, "raas")
    return ChildSpec(name, [*_cli(cluster_file), "raas", "--recipe", str(recipe_file), "--pool", pool,
                            "--node-id", name], child_env(cluster_file, recipe.run, threads, credential),
                     run_dir / "logs" / f"{name}.log")


def _cli(cluster_file: Path) -> list[str]:
    return [sys.executable, "-m", "astraflow.cli.main", "--config", str(cluster_file)]


def cluster_for_run(cfg: ClusterConfig, run_id: str) -> ClusterConfig:
    return cfg.model_copy(update={"run": run_id})


class PrometheusTargets:
    """Gives each component of a run a free loopback port for its ``/metrics``
    (``ASTRAFLOW_PROMETHEUS_PORT``; the same port again for the same component name, e.g. a node the
    actuator starts anew) and keeps ``run_dir/prometheus.json`` listing them in Prometheus's file-based
    service discovery format (``file_sd_configs``, re-read by Prometheus as it changes), labelled with
    the component."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "prometheus.json"
        self.ports: dict[str, int] = {}

    def serve(self, spec: ChildSpec) -> ChildSpec:
        """``spec`` with its port in its environment."""
        import dataclasses
        import json
        import socket

        if spec.name not in self.ports:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                self.ports[spec.name] = sock.getsockname()[1]
            targets = [{"targets": [f"127.0.0.1:{port}"], "labels": {"component": name}}
                       for name, port in self.ports.items()]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(targets, indent=2))
            tmp.replace(self.path)  # a scraper never reads half a file
        env = {**spec.env, "ASTRAFLOW_PROMETHEUS_PORT": str(self.ports[spec.name]),
               "ASTRAFLOW_PROMETHEUS_HOST": "127.0.0.1"}
        return dataclasses.replace(spec, env=env)
