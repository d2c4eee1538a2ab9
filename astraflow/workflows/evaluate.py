"""Held-out evaluation with greedy decoding, through the workflow's own episodes.

A policy is evaluated by running its workflow on held-out tasks (one greedy sample each) and
averaging its reward, so a tool-using agent is scored on whole multi-turn episodes and a user's
workflow needs nothing extra. Workflows whose reward is not an accuracy override
:meth:`Workflow.evaluate` (the verifier of ``solver_verifier`` is scored on balanced verdicts).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING, Any

from astraflow.workflows.policy import PolicyClient, SamplingConfig, policy_client

if TYPE_CHECKING:
    from astraflow.records import Task
    from astraflow.workflows.base import Workflow


def greedy(client: PolicyClient) -> PolicyClient:
    """The same policy with temperature 0 (and its usual response length)."""
    sampling = SamplingConfig(max_new_tokens=client.sampling.max_new_tokens, temperature=0.0)
    return policy_client(client.name, client.engine, client.tokenizer, sampling, client.max_context,
                         client.end_of_turn_ids)


async def episode_accuracy(workflow: Workflow, policy: str, client: PolicyClient, tasks: list[Task]) -> dict[str, Any]:
    """Mean reward of ``policy`` over one greedy episode per task, with the workflow's counters
    for those episodes (tool calls, malformed calls, ...)."""
    before = Counter(workflow.counters)
    one = [_single_sample(t) for t in tasks]
    results = await asyncio.gather(*(workflow.run_episode(t, {policy: greedy(client)}) for t in one))
    rewards = [tr.reward for trajs in results if trajs for tr in trajs if tr.policy == policy]
    counters = Counter(workflow.counters)
    counters.subtract(before)
    out: dict[str, Any] = {"accuracy": sum(rewards) / len(tasks) if tasks else 0.0,
                           "correct": int(sum(r > 0.5 for r in rewards)), "n": len(tasks),
                           "rejected": sum(1 for r in results if r is None)}
    out.update({k: v for k, v in counters.items() if v})
    return out


def _single_sample(task: Task) -> Task:
    from dataclasses import replace

    return replace(task, samples=1)
