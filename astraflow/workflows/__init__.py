"""Episode logic: workflows, reward plug-ins and the policy handle workflows call, each by name."""

from astraflow.registry import plugin_field
from astraflow.workflows.base import (
    WORKFLOWS,
    PolicyClient,
    SamplingConfig,
    Workflow,
    WorkflowConfig,
    build_workflow,
    register_workflow,
)
from astraflow.workflows.rewards import REWARDS, Reward, RewardField, build_reward, register_reward

WorkflowField = plugin_field(WORKFLOWS)
"""Pydantic field type of a recipe's workflow section."""

# Built-in workflows register themselves on import.
from astraflow.workflows import env_agent as _env_agent  # noqa: F401
from astraflow.workflows import math as _math  # noqa: F401
from astraflow.workflows import solver_verifier as _sv  # noqa: F401
from astraflow.workflows import tool_agent as _tool_agent  # noqa: F401

__all__ = ["REWARDS", "WORKFLOWS", "PolicyClient", "Reward", "RewardField", "SamplingConfig", "Workflow",
           "WorkflowConfig", "WorkflowField", "build_reward", "build_workflow", "register_reward",
           "register_workflow"]
