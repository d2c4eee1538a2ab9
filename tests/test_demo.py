"""Demo helpers that need no cluster: recipe lookup, roles, and the failure exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config import ClusterConfig
from astraflow.demo import DemoOptions, recipe_path, run_demo
from astraflow.recipe import Recipe


def test_demo_recipes_are_found_by_name() -> None:
    for name in ("math", "solver_verifier"):
        assert recipe_path(name).name == f"{name}.yaml"
    with pytest.raises(FileNotFoundError, match="nope"):
        recipe_path("nope")


def test_roles_are_declared_by_the_workflow() -> None:
    sv = Recipe.load(recipe_path("solver_verifier"))
    assert (sv.role("solver"), sv.role("verifier")) == ("solver", "verifier")
    assert Recipe.load(recipe_path("math")).role("policy") == "solver"


def test_unknown_recipe_exits_non_zero(tmp_path: Path) -> None:
    assert run_demo(ClusterConfig(state_dir=tmp_path), DemoOptions(recipes=["nope"])) == 2


def test_balanced_verifier_candidates_are_half_right() -> None:
    """The demo's solver_verifier recipe relies on verifier_group "balanced" (see the recipe)."""
    from types import SimpleNamespace

    from astraflow.workflows.solver_verifier import balanced_candidates

    task = SimpleNamespace(prompt_id="p1", prompt="max 3 7 1 =", answer="7")
    for texts in (["7"] * 8, ["3"] * 8, ["7", "3", "7", "1", "7", "7", "7", "7"]):
        truth = [t == "7" for t in texts]
        cands, labels = balanced_candidates(task, texts, truth)
        assert len(cands) == 8 and sum(labels) == 4
        assert cands[:4] == texts[:4] and labels[:4] == truth[:4]
        assert all((c == "7") == lab for c, lab in zip(cands, labels))


def test_balanced_verifier_candidates_take_as_many_solver_answers_as_asked() -> None:
    """``verifier_from_solver``: the first k solver answers, the rest constructed, still half right."""
    from types import SimpleNamespace

    from astraflow.workflows.solver_verifier import balanced_candidates

    task = SimpleNamespace(prompt_id="p1", prompt="max 3 7 1 =", answer="7")
    texts = ["9", "9", "7", "9", "9", "9", "9", "9"]
    truth = [t == "7" for t in texts]
    for k in (0, 2, 8):
        cands, labels = balanced_candidates(task, texts, truth, from_solver=k)
        assert len(cands) == 8 and cands[:k] == texts[:k] and labels[:k] == truth[:k]
        assert all((c == "7") == lab for c, lab in zip(cands, labels))
        assert sum(labels) == (1 if k == 8 else 4)  # 8 solver answers, one right: nothing left to balance with
    constructed, labels = balanced_candidates(task, texts, truth, from_solver=0)
    # the wrong ones are numbers of the problem or near misses of 7 (wrong_answer's kinds)
    assert {c for c, right in zip(constructed, labels) if not right} <= {"3", "1", "5", "6", "8", "9", "10"}
