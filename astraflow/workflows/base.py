"""The workflow contract: one episode of a task, possibly calling several policies' engines."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.registry import Registry


class SamplingConfig(BaseModel):
    """Sampling settings of one policy inside a workflow."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = 4
    """Longest response (the EOS token counts)."""
    temperature: float = 1.0
    """Sampling temperature (must equal the trainer backend's temperature)."""
    top_p: float = 1.0
    """Nucleus mass."""

    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p)


class Workflow(ABC):
    """Turns a Task into trajectories by calling engines; ``None`` rejects the task."""

    name: str = ""

    @abstractmethod
    async def run_episode(self, task: Any, engines: dict[str, Engine]) -> list[Any] | None:
        """Trajectories of every policy the episode used (``node_id`` is left for the node to set)."""

    # -- helpers shared by the built-in workflows -------------------------------------------------
    @staticmethod
    def tokenizer():
        from astraflow.models.tokenizer import build_tokenizer

        return build_tokenizer()

    def encode_prompt(self, text: str) -> list[int]:
        tok = self.tokenizer()
        return [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]

    def decode_response(self, token_ids: list[int]) -> str:
        tok = self.tokenizer()
        return tok.decode([t for t in token_ids if t != tok.eos_token_id], skip_special_tokens=False)

    @staticmethod
    def engine_for(engines: dict[str, Engine], policy: str) -> Engine:
        try:
            return engines[policy]
        except KeyError:
            raise ValueError(f"no engine for policy {policy!r}; have {sorted(engines)}") from None

    @staticmethod
    def trajectory(task: Any, policy: str, index: int, prompt_ids: list[int], gen: Generation,
                   reward: float, rewards: dict[str, float], gen_seconds: float):
        from astraflow.records import Trajectory, episode_id_for, group_id_for

        n = len(gen.token_ids)
        return Trajectory(
            episode_id=episode_id_for(task.prompt_id, policy, index),
            task_id=task.prompt_id,
            group_id=group_id_for(task.prompt_id, policy),
            sample_index=index,
            policy=policy,
            prompt_ids=list(prompt_ids),
            response_ids=list(gen.token_ids),
            logprobs=list(gen.logprobs),
            versions=list(gen.versions),
            loss_mask=[1] * n,
            reward=float(reward),
            rewards=dict(rewards),
            turn_bounds=[0, n],
            node_id="",
            created_at=time.time(),
            gen_seconds=gen_seconds,
            task_type=task.task_type,
        )


WORKFLOWS: Registry[type[Workflow]] = Registry("workflow")


def register_workflow(name: str) -> Callable[[type[Workflow]], type[Workflow]]:
    def deco(cls: type[Workflow]) -> type[Workflow]:
        WORKFLOWS.register(name)(cls)
        cls.name = name
        return cls
    return deco


def build_workflow(name: str, **config: Any) -> Workflow:
    """The workflow registered under ``name`` configured with ``config``."""
    return WORKFLOWS.get(name)(**config)
