"""How a verifier policy is prompted: the problem, then the candidate answer to judge."""

from __future__ import annotations


def verifier_prompt(problem_prompt: str, candidate: str) -> str:
    """``check max 3 7 1 = 7 ?`` : the verifier answers ``<yes>`` or ``<no>``.

    An empty or malformed candidate is shown as ``?`` so the verifier always sees a well-formed
    input (and learns that it is wrong).
    """
    cand = " ".join(candidate.split()) or "?"
    return f"check {problem_prompt} {cand} ?"
