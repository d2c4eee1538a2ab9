"""Two policies in one episode: a solver answers, a verifier judges each answer.

The solver samples ``task.samples`` answers (reward: answer correct). For every answer the verifier
sees ``<problem> <answer>`` and emits a verdict, ``<yes>`` or ``<no>`` (reward: the verdict matches
the truth; anything else scores 0). Each policy gets its own trajectories and its own GRPO group
(``<prompt_id>/solver``, ``<prompt_id>/verifier``), so two trainers can consume them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from astraflow.tasks.verify import verifier_prompt, wrong_answer
from astraflow.workflows.base import PolicyClient, SFTExample, Workflow, WorkflowConfig, register_workflow
from astraflow.workflows.policy import render_messages
from astraflow.workflows.rewards import RewardField, build_reward
from astraflow.workflows.transcript import Transcript

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from astraflow.records import Task, Trajectory
    from astraflow.tasks import Problem


@register_workflow("solver_verifier")
class SolverVerifierWorkflow(Workflow):
    class Config(WorkflowConfig):
        type: Literal["solver_verifier"] = "solver_verifier"
        solver_policy: str = "solver"
        """The policy that answers."""
        verifier_policy: str = "verifier"
        """The policy that judges each answer."""
        reward: RewardField = Field(default="exact_match", validate_default=True)
        """Reward plug-in scoring the solver's answers (and so the truth the verifier must find)."""
        verifier_group: Literal["prompt", "answer", "balanced"] = "prompt"
        """"prompt": one verdict per solver answer, one verifier group per prompt (baseline = the
        verifier's mean score on this prompt); "answer": ``task.samples`` verdicts per solver answer,
        one group per answer (``<prompt_id>/verifier/<i>``), so the solver's growing share of right
        answers cannot bias the baseline (costs ``samples``x more verifier tokens); "balanced": one
        group per prompt over ``task.samples`` candidates, the first half of the solver's answers
        topped up with the reference answer or plausible wrong ones so that right and wrong
        candidates are equal in number (as the solver improves, "always yes" no longer pays)."""
        verifier_from_solver: int | None = Field(default=None, ge=0)
        """"balanced" only: how many of the solver's answers each verifier group judges, the rest
        constructed (None: half of ``task.samples``). 0: the verifier trains on constructed candidates
        only (the reference answer and ``wrong_answer``'s, the held-out set's kinds); the solver's own
        wrong answers are mostly unlike those (a rule's digit that is not in the problem)."""
        verifier_chat: bool = True
        """Render the verifier's prompt with its chat template; ``false``: plain text (the tokens of
        ``<problem> <candidate>``, the candidate last), the layout the demo's 2-layer model learns
        verdicts in (with the ChatML framing after the candidate it stayed at chance, 0.500)."""
        yes: str = "<yes>"
        """Verdict text meaning "correct" (a special token of the demo tokenizer)."""
        no: str = "<no>"
        """Verdict text meaning "wrong"."""

        @model_validator(mode="after")
        def _from_solver_needs_balanced(self) -> SolverVerifierWorkflow.Config:
            if self.verifier_from_solver is not None and self.verifier_group != "balanced":
                raise ValueError(f"verifier_from_solver applies to verifier_group 'balanced', not {self.verifier_group!r}")
            return self

        def policies(self) -> list[str]:
            return [self.solver_policy, self.verifier_policy]

        def roles(self) -> dict[str, str]:
            return {self.solver_policy: "solver", self.verifier_policy: "verifier"}

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.reward = build_reward(config.reward)

    def warm_start_examples(self, policy: str, problems: list[Problem], tokenizer: PreTrainedTokenizerBase,
                            seed: int = 0) -> list[SFTExample]:
        """The solver learns answers (the default); the verifier learns verdicts on candidates that
        are right or plausibly wrong with equal probability."""
        if policy != self.config.verifier_policy:
            return super().warm_start_examples(policy, problems, tokenizer, seed)
        import random

        rng = random.Random(f"verifier-sft/{seed}")
        out = []
        for p in problems:
            good = rng.random() < 0.5
            cand = p.answer if good else wrong_answer(p, rng)
            prompt = self.verifier_prompt_ids(tokenizer, verifier_prompt(p.prompt, cand))
            verdict = self.config.yes if good else self.config.no
            out.append(SFTExample.completion(
                prompt, [*tokenizer.encode(verdict, add_special_tokens=False), tokenizer.eos_token_id]))
        return out

    async def evaluate(self, policy: str, client: PolicyClient, tasks: list[Task]) -> dict[str, Any]:
        """The solver: greedy answer accuracy. The verifier: greedy verdict accuracy on a balanced
        set, each task once with its reference answer and once with a plausible wrong one (so
        always-yes or always-no scores 0.5)."""
        import random

        from astraflow.tasks.base import Problem
        from astraflow.workflows.evaluate import greedy

        client = greedy(client)
        if policy != self.config.verifier_policy:
            gens = await client.generate([client.prompt_ids(t) for t in tasks])
            ok = sum(self.reward(client.decode(g.token_ids), t) > 0.5 for t, g in zip(tasks, gens, strict=True))
            return {"accuracy": ok / len(tasks), "correct": int(ok), "n": len(tasks)}
        rng = random.Random(f"verifier-eval/{tasks[0].prompt_id if tasks else ''}")
        items = []
        for t in tasks:
            wrong = wrong_answer(Problem(prompt_id=t.prompt_id, prompt=t.prompt, answer=t.answer), rng)
            items += [(verifier_prompt(t.prompt, t.answer), True, "right"),
                      (verifier_prompt(t.prompt, wrong), False, candidate_kind(t.prompt, wrong))]
        gens = await client.generate([self.verifier_prompt_ids(client.tokenizer, text) for text, _, _ in items])
        hits = [self.verdict(client.decode(g.token_ids)) == want for (_, want, _), g in zip(items, gens, strict=True)]
        by_kind: dict[str, list[bool]] = {}
        for (_, _, kind), hit in zip(items, hits, strict=True):
            by_kind.setdefault(kind, []).append(hit)
        ok = sum(hits)
        return {"accuracy": ok / len(items), "correct": int(ok), "n": len(items),
                "by_candidate": {kind: {"accuracy": sum(h) / len(h), "n": len(h)} for kind, h in sorted(by_kind.items())}}

    def verifier_prompt_ids(self, tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
        """The verifier's prompt ids for ``text`` (chat-rendered or plain, see ``verifier_chat``)."""
        if self.config.verifier_chat:
            return render_messages(tokenizer, [{"role": "user", "content": text}])
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return [*bos, *tokenizer.encode(text, add_special_tokens=False)]

    def verdict(self, text: str) -> bool | None:
        """True for the yes verdict, False for no, None for anything else (a malformed verdict)."""
        text = text.strip()
        if text.startswith(self.config.yes):
            return True
        if text.startswith(self.config.no):
            return False
        return None

    async def run_episode(self, task: Task, policies: Mapping[str, PolicyClient]) -> list[Trajectory] | None:
        cfg = self.config
        solver = self.policy(policies, cfg.solver_policy)
        verifier = self.policy(policies, cfg.verifier_policy)
        prompt_ids = solver.prompt_ids(task)
        t0 = time.perf_counter()
        answers = await solver.generate([prompt_ids] * task.samples)
        t_solve = time.perf_counter() - t0
        texts = [solver.decode(g.token_ids) for g in answers]
        correct = [self.reward(t, task) for t in texts]
        cands, truth = texts, [c > 0.5 for c in correct]
        if cfg.verifier_group == "balanced":
            cands, truth = balanced_candidates(task, texts, truth, cfg.verifier_from_solver)
        v_prompts = [self.verifier_prompt_ids(verifier.tokenizer, verifier_prompt(task.prompt, t))
                     for t in cands]
        t1 = time.perf_counter()
        k = task.samples if cfg.verifier_group == "answer" else 1
        verdicts = await verifier.generate([vp for vp in v_prompts for _ in range(k)])
        t_verify = time.perf_counter() - t1
        out = []
        for i, (g, r) in enumerate(zip(answers, correct, strict=True)):
            tr = Transcript(prompt_ids)
            tr.add_generation(g, t_solve)
            out.append(tr.to_trajectory(task, cfg.solver_policy, i, r, {self.reward.name: r}))
        for j, g in enumerate(verdicts):
            i = j // k
            v = self.verdict(verifier.decode(g.token_ids))
            vr = float(v is not None and v == truth[i])
            tr = Transcript(v_prompts[i])
            tr.add_generation(g, t_verify)
            t = tr.to_trajectory(task, cfg.verifier_policy, j, vr,
                                 {"verdict_correct": vr, "solver_correct": float(truth[i])})
            if cfg.verifier_group == "answer":
                t.group_id = f"{task.prompt_id}/{cfg.verifier_policy}/{i}"
            out.append(t)
        return out


def candidate_kind(prompt: str, wrong: str) -> str:
    """How a wrong candidate is wrong: ``wrong_in_prompt`` (another number of the problem, which only
    reading the problem refutes) or ``wrong_other`` (a number the problem does not hold)."""
    return "wrong_in_prompt" if wrong in prompt.split() else "wrong_other"


def balanced_candidates(task: Task, texts: list[str], truth: list[bool],
                        from_solver: int | None = None) -> tuple[list[str], list[bool]]:
    """``len(texts)`` answers to verify, half right and half wrong (as far as the solver's allow): the
    first ``from_solver`` of the solver's answers (None: half), then the reference answer / plausible
    wrong answers (seeded by the prompt id)."""
    import random

    from astraflow.tasks.base import Problem

    n = len(texts)
    taken = n // 2 if from_solver is None else min(from_solver, n)
    cands, labels = list(texts[:taken]), list(truth[:taken])
    right_needed = max(0, min(n - taken, n // 2 - sum(labels)))
    rng = random.Random(f"balanced-verifier/{task.prompt_id}")
    problem = Problem(prompt_id=task.prompt_id, prompt=task.prompt, answer=task.answer)
    cands += [task.answer] * right_needed
    labels += [True] * right_needed
    for _ in range(n - taken - right_needed):
        cands.append(wrong_answer(problem, rng))
        labels.append(False)
    return cands, labels
