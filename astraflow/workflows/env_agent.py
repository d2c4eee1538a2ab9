"""A multi-turn agent in an environment plug-in (an HTTP task server, a simulator, ...).

Per sample: ``start`` gives the first observation, which becomes the user message after the
system prompt; every assistant turn's decoded text is the action passed to ``step``; the returned
observation is appended as a ``user`` (or ``tool``) message, tokenised once with the chat template's
framing (loss mask 0); the episode ends when the environment says ``done``. The reward is the sum
(or the last) of the environment's step rewards.

Limits: ``max_turns`` actions and ``max_total_tokens`` of prompt + response (default: the policy's
context length); a turn cut by its token limit ends the episode too. The environment is told with
``cancel``, and the episode scores ``truncated_reward`` when one is set, else what it earned so far.

Failures: an :class:`EnvironmentFailure` in any sample rejects the whole GRPO group — the other
samples are cancelled (their environment episodes too), the workflow returns ``None`` and counts
``env_failure``. A group is never returned in part: skipping the failed samples would bias the
group's baseline.

Counters: ``episodes``, ``done``, ``env_steps``, ``truncated`` (with ``truncated_turns`` /
``truncated_tokens`` / ``truncated_length``), ``env_failure``, ``env_cancel_failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from astraflow.environments.base import EnvironmentFailure, EnvironmentField, build_environment
from astraflow.workflows.base import PolicyClient, Workflow, WorkflowConfig, register_workflow
from astraflow.workflows.policy import with_system
from astraflow.workflows.transcript import Transcript

if TYPE_CHECKING:
    from astraflow.records import Task, Trajectory


@register_workflow("env_agent")
class EnvAgentWorkflow(Workflow):
    class Config(WorkflowConfig):
        type: Literal["env_agent"] = "env_agent"
        policy: str = "agent"
        """The policy that acts (a task's own ``policy`` field wins when set)."""
        environment: EnvironmentField
        """Environment plug-in and its options (``{type: http, url: ...}``)."""
        max_turns: int = Field(default=8, ge=1)
        """Most actions per episode."""
        max_total_tokens: int | None = Field(default=None, ge=1)
        """Most prompt + response tokens per episode; ``None``: the policy's context length."""
        system_prompt: str | None = None
        """System message before the first observation."""
        observation_role: str = "user"
        """Chat role of observations after the first ("user" or "tool")."""
        reward: Literal["sum", "last"] = "sum"
        """Episode reward: the sum of the step rewards, or the last one."""
        truncated_reward: float | None = None
        """Reward of an episode stopped by a limit; ``None`` keeps what it earned so far."""

        def policies(self) -> list[str]:
            return [self.policy]

        def roles(self) -> dict[str, str]:
            return {self.policy: "agent"}

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.environment = build_environment(config.environment)

    async def run_episode(self, task: Task, policies: Mapping[str, PolicyClient]) -> list[Trajectory] | None:
        name = task.policy or self.config.policy
        policy = self.policy(policies, name)
        samples = [asyncio.ensure_future(self._sample(task, policy, i)) for i in range(task.samples)]
        try:
            await asyncio.wait(samples, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # a failed sample, or this episode cancelled (node stopping): end the others
            pending = [s for s in samples if not s.done()]
            for s in pending:
                s.cancel()
            await asyncio.gather(*pending, return_exceptions=True)  # each cancels its own episode
        failed = next((s for s in samples if not s.cancelled() and s.exception()), None)
        if failed is not None:
            if isinstance(failed.exception(), EnvironmentFailure):
                self.counters["env_failure"] += 1
                return None
            raise failed.exception()  # a bug, not the environment: surface it
        out = []
        for i, s in enumerate(samples):
            tr, reward, figures = s.result()
            out.append(tr.to_trajectory(task, name, i, reward, figures))
        return out

    async def _sample(self, task: Task, policy: PolicyClient, index: int) -> tuple[Transcript, float, dict[str, float]]:
        cfg = self.config
        start = await self.environment.start(task, index)
        try:
            messages = with_system([{"role": "user", "content": start.observation}], cfg.system_prompt)
            tr = Transcript(policy.render(messages))
            rewards: list[float] = []
            stop = await self._turns(tr, policy, start.episode_id, rewards)
        except BaseException:  # failure elsewhere in the group, or here: end the server's episode
            with contextlib.suppress(Exception):
                await asyncio.shield(self.environment.cancel(start.episode_id))
            raise
        seen: Counter[str] = Counter(episodes=1, env_steps=len(rewards))
        earned = (sum(rewards) if cfg.reward == "sum" else rewards[-1]) if rewards else 0.0
        if stop == "done":
            seen["done"] += 1
            reward = earned
        else:
            seen.update({"truncated": 1, f"truncated_{stop}": 1})
            reward = earned if cfg.truncated_reward is None else cfg.truncated_reward
            try:
                await self.environment.cancel(start.episode_id)
            except EnvironmentFailure:
                seen["env_cancel_failed"] += 1
        self.counters.update(seen)
        figures = {"env_reward": earned, "turns": float(tr.model_turns), "env_steps": float(len(rewards)),
                   "done": float(stop == "done"), "truncated": float(stop != "done")}
        return tr, reward, figures

    async def _turns(self, tr: Transcript, policy: PolicyClient, episode_id: str, rewards: list[float]) -> str:
        """Act until the environment is done or a limit hits: "done", "turns", "tokens" or "length"."""
        cfg = self.config
        budget = cfg.max_total_tokens or policy.max_context
        per_turn = policy.sampling.max_new_tokens
        for _ in range(cfg.max_turns):
            room = budget - len(tr) if budget else per_turn
            if room < 1:
                return "tokens"
            t0 = time.perf_counter()
            [gen] = await policy.generate([tr.context()], min(per_turn, room))
            tr.add_generation(gen, time.perf_counter() - t0)
            if gen.finish_reason != "stop":
                return "length" if room >= per_turn else "tokens"
            step = await self.environment.step(episode_id, policy.decode(gen.token_ids))
            rewards.append(float(step.reward))
            if step.done:
                return "done"
            obs_ids = policy.message_ids(cfg.observation_role, step.observation)
            if budget and len(tr) + len(obs_ids) >= budget:
                return "tokens"
            tr.add_observation(obs_ids)
        return "turns"
