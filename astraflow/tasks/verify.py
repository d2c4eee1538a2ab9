"""How a verifier policy is prompted: the problem, then the candidate answer to judge."""

from __future__ import annotations


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
