"""A policy's trainer with ``trainer.ranks`` > 1 on Kubernetes: an Indexed Job of torch.distributed.run
agents and the headless Service that names them (``astraflow deploy k8s``).

Only built-in kinds (no operator to install): ``batch/v1`` Job with ``completionMode: Indexed`` and a
``v1`` Service with ``clusterIP: None``. Each pod runs one torch.distributed.run agent with
``ranks_per_pod`` workers, the same worker command ``astraflow run`` starts
(:func:`astraflow.trainer.launch.rank_group_argv`), joined by torchrun's c10d rendezvous:

* ``--nnodes`` = the Job's pods; ``--rdzv-endpoint`` = pod 0's stable name, ``<job>-0.<service>``
  (an Indexed Job's pods are named ``<job>-<index>``, and a pod whose ``subdomain`` is a headless
  Service gets that DNS name), on :data:`RENDEZVOUS_PORT`; ``--rdzv-id`` = run and policy, so a
  group's agents never meet another run's;
* ``--max-restarts 0`` and ``restartPolicy: Never``: a dead rank ends its agent, which ends every
  other rank's collectives and so every agent, and the Job controller replaces the failed pods; the
  new agents meet again at the rendezvous (torchrun restarts the workers of an agent still waiting
  when a new member joins) and the group resumes from its last checkpoint. ``backoffLimit`` counts
  pod failures: :class:`~astraflow.launcher.restarts.RestartPolicy`'s restarts of the whole group;
* the Service publishes not-ready addresses: the pods must find pod 0 before any of them is ready.

A CUDA backend gets ``nvidia.com/gpu: ranks_per_pod`` per pod and a memory-backed ``/dev/shm``
(torch's default 64 MiB is too small for NCCL and the workers' shared tensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astraflow.config import ConfigError
from astraflow.deploy.kit import Kit, Manifest
from astraflow.launcher.restarts import RestartPolicy
from astraflow.trainer.launch import rank_group_argv

if TYPE_CHECKING:
    from astraflow.recipe import PolicySpec, Recipe

RENDEZVOUS_PORT = 29400
"""torchrun's default c10d rendezvous port, served by pod 0's agent."""
TORCHRUN = ["python", "-m", "torch.distributed.run"]
"""The image's Python (infra/Dockerfile puts its virtualenv first on PATH)."""
_HOSTNAME_MAX = 63


def pods_of(ranks: int, ranks_per_pod: int) -> int:
    if ranks % ranks_per_pod:
        raise ConfigError(f"trainer.ranks = {ranks} is not a multiple of {ranks_per_pod} ranks per pod")
    return ranks // ranks_per_pod


def trainer_group(k: Kit, recipe: Recipe, policy: PolicySpec, ranks_per_pod: int) -> list[Manifest]:
    """The headless Service and the Indexed Job of ``policy``'s trainer over ``recipe.trainer.ranks`` ranks."""
    component = f"trainer-{policy.name}"
    pods = pods_of(recipe.trainer.ranks, ranks_per_pod)
    job = k.name(component)
    if len(f"{job}-{pods - 1}") > _HOSTNAME_MAX:
        raise ConfigError(f"trainer Job name {job!r} leaves no room for its pods' index in a 63-character "
                          "host name: use a shorter run id or policy name")
    service = k.name(component, "ranks")
    argv = rank_group_argv(["trainer", "--recipe", k.opts.recipe_path, "--policy", policy.name], ranks_per_pod,
                           nnodes=pods, rdzv_endpoint=f"{job}-0.{service}:{RENDEZVOUS_PORT}",
                           rdzv_id=f"{k.run}-{policy.name}", python=TORCHRUN[0])
    assert argv[:3] == TORCHRUN
    cuda = str(getattr(policy.backend, "device", "cpu")).startswith("cuda")
    pod = k.pod(component, argv[3:], command=TORCHRUN, restart="Never",
                resources={"limits": {"nvidia.com/gpu": ranks_per_pod}} if cuda else None, shm=True)
    pod["spec"]["subdomain"] = service
    headless: dict[str, Any] = {
        "clusterIP": "None", "publishNotReadyAddresses": True, "selector": k.labels(component),
        "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}]}
    spec = {"completionMode": "Indexed", "completions": pods, "parallelism": pods,
            "backoffLimit": RestartPolicy().max_restarts * pods, "template": pod}
    return [k.obj("v1", "Service", service, component, headless), k.obj("batch/v1", "Job", job, component, spec)]
