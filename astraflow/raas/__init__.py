"""RaaS (rollout as a service): a stateless node that consumes tasks, runs workflow episodes with
one engine per policy, produces trajectories tagged with per-token weight versions, and follows
the weight plane. ``run_raas_node`` is the process entry point."""

from astraflow.raas.inflight import InFlightTasks
from astraflow.raas.node import RaasNode, run_raas_node

__all__ = ["InFlightTasks", "RaasNode", "run_raas_node"]
