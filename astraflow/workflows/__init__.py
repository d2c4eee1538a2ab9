"""Episode logic: workflows and reward plug-ins, each registered by name."""

from astraflow.workflows import math as _math  # noqa: F401  (registers "math")
from astraflow.workflows import solver_verifier as _sv  # noqa: F401  (registers "solver_verifier")
from astraflow.workflows.base import WORKFLOWS, SamplingConfig, Workflow, build_workflow, register_workflow
from astraflow.workflows.rewards import REWARDS, get_reward, register_reward

__all__ = ["REWARDS", "WORKFLOWS", "SamplingConfig", "Workflow", "build_workflow", "get_reward",
           "register_reward", "register_workflow"]
