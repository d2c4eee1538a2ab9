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
                 verifier_sampling: SamplingConfig | dict | None = None,
                 verifier_group: str = "prompt") -> None:
        """``verifier_group``: "prompt" = one verdict per solver answer, one verifier group per prompt
        (baseline = the verifier's mean score on this prompt); "answer" = ``task.samples`` verdicts
        per solver answer, one group per answer (``<prompt_id>/verifier/<i>``), so each input is
        judged against itself and the solver's growing share of right answers cannot bias the
        baseline (costs ``samples``x more verifier tokens); "balanced" = one group per prompt over
        ``task.samples`` candidates: the first half of the solver's answers, topped up with the
        reference answer or a plausible wrong one (:func:`astraflow.sft.wrong_answer`) so that right
        and wrong candidates are equal in number — as the solver improves, "always yes" no longer
        pays, so the verifier must discriminate (the held-out verifier eval is balanced too)."""
        if verifier_group not in ("prompt", "answer", "balanced"):
            raise ValueError(f"verifier_group must be 'prompt', 'answer' or 'balanced', got {verifier_group!r}")
        self.verifier_group = verifier_group
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
        cands, truth = texts, [c > 0.5 for c in correct]
        if self.verifier_group == "balanced":
            cands, truth = balanced_candidates(task, texts, truth)
        v_prompts = [self.encode_prompt(verifier_prompt(task.prompt, t)) for t in cands]
        t1 = time.perf_counter()
        k = task.samples if self.verifier_group == "answer" else 1
        verdicts = await verifier.agenerate([vp for vp in v_prompts for _ in range(k)],
                                            self.verifier_sampling.params())
        t_verify = time.perf_counter() - t1
        out = []
        for i, (g, r) in enumerate(zip(answers, correct, strict=True)):
            out.append(self.trajectory(task, self.solver_policy, i, prompt_ids, g, r,
                                       {self.reward_name: r}, t_solve))
        for j, g in enumerate(verdicts):
            i = j // k
            v = self.verdict(g.token_ids)
            vr = float(v is not None and v == truth[i])
            t = self.trajectory(task, self.verifier_policy, j, v_prompts[i], g, vr,
                                {"verdict_correct": vr, "solver_correct": float(truth[i])}, t_verify)
            if self.verifier_group == "answer":
                t.group_id = f"{task.prompt_id}/{self.verifier_policy}/{i}"
            out.append(t)
        return out


def balanced_candidates(task: Any, texts: list[str], truth: list[bool]) -> tuple[list[str], list[bool]]:
    """``len(texts)`` answers to verify, half right and half wrong: the first half of the solver's
    answers, then the reference answer / plausible wrong answers (seeded by the prompt id)."""
    import random

    from astraflow.sft import wrong_answer
    from astraflow.tasks.base import Problem

    n, half = len(texts), len(texts) // 2
    cands, labels = list(texts[:half]), list(truth[:half])
    right_needed = max(0, min(n - half, n // 2 - sum(labels)))
    rng = random.Random(f"balanced-verifier/{task.prompt_id}")
    problem = Problem(prompt_id=task.prompt_id, prompt=task.prompt, answer=task.answer)
    cands += [task.answer] * right_needed
    labels += [True] * right_needed
    for _ in range(n - half - right_needed):
        cands.append(wrong_answer(problem, rng))
        labels.append(False)
    return cands, labels
