"""Single-policy, single-turn answer checking: sample ``task.samples`` answers, reward each."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from astraflow.workflows.base import PolicyClient, Workflow, WorkflowConfig, register_workflow
from astraflow.workflows.rewards import RewardField, build_reward
from astraflow.workflows.transcript import Transcript

if TYPE_CHECKING:
    from astraflow.records import Task, Trajectory


@register_workflow("math")
class MathWorkflow(Workflow):
    class Config(WorkflowConfig):
        type: Literal["math"] = "math"
        policy: str = "policy"
        """The policy that answers."""
        reward: RewardField = Field(default="exact_match", validate_default=True)
        """Reward plug-in scoring each decoded answer."""
        system_prompt: str | None = None
        """System message prepended to chat prompts (for checkpoints with a chat template)."""

        def policies(self) -> list[str]:
            return [self.policy]

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.reward = build_reward(config.reward)

    async def run_episode(self, task: Task, policies: Mapping[str, PolicyClient]) -> list[Trajectory] | None:
        name = task.policy or self.config.policy
        policy = self.policy(policies, name)
        prompt_ids = policy.prompt_ids(task, self.config.system_prompt)
        t0 = time.perf_counter()
        gens = await policy.generate([prompt_ids] * task.samples)
        secs = time.perf_counter() - t0
        out = []
        for i, g in enumerate(gens):
            r = self.reward(policy.decode(g.token_ids), task)
            transcript = Transcript(prompt_ids)
            transcript.add_generation(g, secs)
            out.append(transcript.to_trajectory(task, name, i, r, {self.reward.name: r}))
        return out
