"""Single-policy answer checking: sample ``task.samples`` answers, reward each with a plug-in."""

from __future__ import annotations

import time
from typing import Any

from astraflow.engines.base import Engine
from astraflow.workflows.base import SamplingConfig, Workflow, register_workflow
from astraflow.workflows.rewards import get_reward


@register_workflow("math")
class MathWorkflow(Workflow):
    def __init__(self, policy: str = "policy", reward: str = "exact_match",
                 sampling: SamplingConfig | dict | None = None) -> None:
        self.policy = policy
        self.reward_name = reward
        self.reward_fn = get_reward(reward)
        self.sampling = SamplingConfig.model_validate(sampling or {})

    async def run_episode(self, task: Any, engines: dict[str, Engine]) -> list[Any] | None:
        policy = task.policy or self.policy
        engine = self.engine_for(engines, policy)
        prompt_ids = list(task.prompt_ids) or self.encode_prompt(task.prompt)
        t0 = time.perf_counter()
        gens = await engine.agenerate([prompt_ids] * task.samples, self.sampling.params())
        secs = time.perf_counter() - t0
        out = []
        for i, g in enumerate(gens):
            r = self.reward_fn(self.decode_response(g.token_ids), task)
            out.append(self.trajectory(task, policy, i, prompt_ids, g, r, {self.reward_name: r}, secs))
        return out
