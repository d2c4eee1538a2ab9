"""Two policies in one episode: a solver answers, a verifier judges each answer.

The solver samples ``task.samples`` answers (reward: answer correct). For every answer the verifier
sees ``check <problem> <answer> ?`` and emits a verdict token, ``<yes>`` or ``<no>`` (reward: the
verdict matches the truth; anything else scores 0). Each policy gets its own trajectories and its
own GRPO group (``<prompt_id>/solver``, ``<prompt_id>/verifier``), so two trainers can consume them.
"""

from __future__ import annotations

import time
from typing import Any

from astraflow.engines.base import Engine
from astraflow.models.tokenizer import NO, YES
from astraflow.tasks.verify import verifier_prompt
from astraflow.workflows.base import SamplingConfig, Workflow, register_workflow
from astraflow.workflows.rewards import get_reward


@register_workflow("solver_verifier")
class SolverVerifierWorkflow(Workflow):
    def __init__(self, solver_policy: str = "solver", verifier_policy: str = "verifier",
                 reward: str = "exact_match", solver_sampling: SamplingConfig | dict | None = None,
                 verifier_sampling: SamplingConfig | dict | None = None) -> None:
        self.solver_policy, self.verifier_policy = solver_policy, verifier_policy
        self.reward_name = reward
        self.reward_fn = get_reward(reward)
        self.solver_sampling = SamplingConfig.model_validate(solver_sampling or {})
        self.verifier_sampling = SamplingConfig.model_validate(verifier_sampling or {"max_new_tokens": 2})

    def verdict(self, token_ids: list[int]) -> bool | None:
        """True for ``<yes>``, False for ``<no>``, None for anything else (a malformed verdict)."""
        tok = self.tokenizer()
        first = token_ids[0] if token_ids else None
        return {tok.convert_tokens_to_ids(YES): True, tok.convert_tokens_to_ids(NO): False}.get(first)

    async def run_episode(self, task: Any, engines: dict[str, Engine]) -> list[Any] | None:
        solver = self.engine_for(engines, self.solver_policy)
        verifier = self.engine_for(engines, self.verifier_policy)
        prompt_ids = list(task.prompt_ids) or self.encode_prompt(task.prompt)
        t0 = time.perf_counter()
        answers = await solver.agenerate([prompt_ids] * task.samples, self.solver_sampling.params())
        t_solve = time.perf_counter() - t0
        texts = [self.decode_response(g.token_ids) for g in answers]
        correct = [self.reward_fn(t, task) for t in texts]
        v_prompts = [self.encode_prompt(verifier_prompt(task.prompt, t)) for t in texts]
        t1 = time.perf_counter()
        verdicts = await verifier.agenerate(v_prompts, self.verifier_sampling.params())
        t_verify = time.perf_counter() - t1
        out = []
        for i, (g, r) in enumerate(zip(answers, correct)):
            out.append(self.trajectory(task, self.solver_policy, i, prompt_ids, g, r,
                                       {self.reward_name: r}, t_solve))
        for i, (g, r, vp) in enumerate(zip(verdicts, correct, v_prompts)):
            v = self.verdict(g.token_ids)
            vr = float(v is not None and v == (r > 0.5))
            out.append(self.trajectory(task, self.verifier_policy, i, vp, g, vr,
                                       {"verdict_correct": vr, "solver_correct": r}, t_verify))
        return out
