"""Typed control records with plausible defaults, for tests that feed the live view, the actuator or a
reader of ``metrics.jsonl``: each builder takes the fields a test cares about and fills the rest."""

from __future__ import annotations

from typing import Any

from astraflow.records.control import (
    ActuatorEvent,
    AutoscaleReport,
    DataflowCounters,
    NodeStatus,
    PoolReport,
    SupervisorEvent,
    TrainerDone,
    TrainerStart,
    TrainerStep,
)


def trainer_start(policy: str = "policy", step: int = 0, **fields: Any) -> TrainerStart:
    return TrainerStart(**{"id": f"trainer.{policy}", "time": 100.0, "policy": policy, "life": "life-1", "step": step,
                           "version": step, "origin": "seeded model", **fields})


def trainer_step(policy: str = "policy", step: int = 1, **fields: Any) -> TrainerStep:
    return TrainerStep(**{
        "id": f"trainer.{policy}", "time": 100.0 + step, "policy": policy, "life": "life-1", "step": step,
        "version": step, "batch_id": f"{policy}-b{step}", "loss": 0.1, "reward_mean": 0.5, "staleness_mean": 0.5,
        "staleness_max": 1, "wait_s": 0.3, "step_s": 1.0, "trajectories": 16, "tokens": 400, "grad_norm": 1.0,
        "handoff_ms": {}, "state_copy_s": 0.01, "publish_blocked_s": 0.0, "publish_bytes": 3000,
        "publish_kind": "delta", "publish_s": 0.05, "weights_gc_deleted": 0, "checkpoints_deleted": 0, **fields})


def trainer_done(policy: str = "policy", step: int = 1, **fields: Any) -> TrainerDone:
    return TrainerDone(**{"id": f"trainer.{policy}", "time": 200.0, "policy": policy, "life": "life-1", "step": step,
                          "version": step, "skipped": {}, **fields})


def node_status(node: str = "raas-default-0", pool: str = "default", **fields: Any) -> NodeStatus:
    return NodeStatus(**{
        "id": node, "time": 100.0, "node_id": node, "pool": pool, "episodes": 1, "rejected": 0, "trajectories": 4,
        "tokens": 100, "tokens_per_s": 10.0, "versions": {}, "busy_fraction": 0.5, "refresh_s": 0.0,
        "in_flight": 0, "workflow": {}, "counters": {}, "handoff_ms": {}, **fields})


def dataflow_counters(counters: dict[str, int] | None = None, **fields: Any) -> DataflowCounters:
    return DataflowCounters(**{"time": 100.0, "versions": {}, "counters": counters or {}, "handoff_ms": {}, **fields})


def autoscale_report(time: float = 100.0, **targets: tuple[int, int]) -> AutoscaleReport:
    """``pool=(nodes seen, target nodes)`` per pool."""
    pools = {pool: PoolReport(nodes=seen, target_nodes=target, reason="in_band" if seen == target else
                              ("trainer_starved" if target > seen else "rollout_surplus"))
             for pool, (seen, target) in targets.items()}
    return AutoscaleReport(time=time, pools=pools)


def restart(component: str, restarts: int = 1, returncode: int | None = -9) -> SupervisorEvent:
    return SupervisorEvent(component=component, event="restart", returncode=returncode, restarts=restarts,
                           time=100.0, backoff_s=0.5, pid=1234)


def actuator_event(event: str, pool: str = "default", **fields: Any) -> ActuatorEvent:
    return ActuatorEvent(pool=pool, event=event, time=100.0, **fields)
