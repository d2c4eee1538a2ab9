"""Demo helpers that need no cluster: recipe lookup, roles, and the failure exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config import ClusterConfig
from astraflow.demo import DemoOptions, recipe_path, run_demo, verifier_policy
from astraflow.recipe import Recipe


def test_demo_recipes_are_found_by_name() -> None:
    for name in ("math", "solver_verifier"):
        assert recipe_path(name).name == f"{name}.yaml"
    with pytest.raises(FileNotFoundError, match="nope"):
        recipe_path("nope")


def test_roles() -> None:
    assert verifier_policy(Recipe.load(recipe_path("solver_verifier"))) == "verifier"
    assert verifier_policy(Recipe.load(recipe_path("math"))) is None


def test_unknown_recipe_exits_non_zero(tmp_path: Path) -> None:
    assert run_demo(ClusterConfig(state_dir=tmp_path), DemoOptions(recipes=["nope"])) == 2
