"""Builders of the dataflow tests: tasks, trajectories and rollouts of a policy, varied rewards, and a
small dataflow config."""

from __future__ import annotations

from fakes import make_trajectory

from astraflow.dataflow import DataflowConfig
from astraflow.dataflow.service import DataflowService
from astraflow.records import Task, Trajectory


def dataset(n: int, samples: int = 4, policy: str = "", **meta) -> list[Task]:
    return [Task(f"p{i}", f"q{i}", [1, 2], str(i), samples=samples, task_type="arith", policy=policy,
                 metadata={k: str(v) for k, v in meta.items()}) for i in range(n)]


def traj(task: Task, policy: str, i: int, reward: float, version: int = 0, n: int = 3) -> Trajectory:
    return make_trajectory(task.prompt_id, policy, i, n=n, version=version, reward=reward, prompt_ids=[1, 2],
                           response_ids=[5] * n, logprobs=[-1.0] * n, task_type=task.task_type)


def rollout(task: Task, policy: str, rewards: list[float], version: int = 0) -> list[Trajectory]:
    return [traj(task, policy, i, r, version) for i, r in enumerate(rewards)]


def varied(k: int) -> list[float]:
    return [float(i % 2) for i in range(k)]


def cfg(**kw) -> DataflowConfig:
    base = {"policies": ["solver"], "groups_per_batch": 2, "max_staleness": 1}
    return DataflowConfig.model_validate({**base, **kw})


def run_dataflow(cfg, section, stop_event, *, dataset, stop_when_finished: bool = False, **options) -> dict[str, int]:
    """A dataflow service run until ``stop_event`` (or, with ``stop_when_finished``, until nothing is
    left); its final counters."""
    return DataflowService(cfg, section, dataset, **options).run(stop_event, stop_when_finished=stop_when_finished)
