"""How a verifier policy is prompted (the problem, then the candidate answer to judge) and the
plausible wrong candidates it is trained and evaluated on."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astraflow.tasks.base import Problem


def verifier_prompt(problem_prompt: str, candidate: str) -> str:
    """``max 3 7 1 = 7``: the problem followed by the candidate answer; the verifier then emits
    ``<yes>`` or ``<no>``.

    The candidate is the *last* prompt token, so the verdict is read at the candidate's own
    position: one attention over the problem (the solver's mechanism) plus a comparison with itself.
    Measured on the tiny model: a trailing ``?`` or a ``check c |`` prefix left the verifier at
    chance after 300 SFT steps, this format reached 65-72%. An empty candidate is shown as ``?``.
    """
    cand = " ".join(candidate.split()) or "?"
    return f"{problem_prompt} {cand}"


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong answer: another number from the prompt when there is one, else a near miss."""
    nums = [w for w in problem.prompt.split() if w.isdigit() and w != problem.answer]
    if nums and rng.random() < 0.7:
        return rng.choice(nums)
    a = int(problem.answer) if problem.answer.isdigit() else 0
    cand = a + rng.choice([-2, -1, 1, 2, 3])
    return str(cand if cand >= 0 and cand != a else a + 1)
