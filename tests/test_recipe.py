"""Recipe validation: every shipped recipe validates; bad ones fail with a message naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astraflow.config import ConfigError
from astraflow.recipe import Recipe

RECIPES = sorted((Path(__file__).parent.parent / "examples" / "recipes").glob("*.yaml"))
MINIMAL = {"policies": [{"name": "policy"}]}


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(path: Path) -> None:
    recipe = Recipe.load(path)
    assert recipe.policies
    for policy in recipe.policies:
        model = recipe.resolve_path(policy.model)
        assert model.exists(), f"{path.name}: model config {policy.model} not found"
    assert set(recipe.dataflow.policies) == {p.name for p in recipe.policies}


def test_shipped_recipes_exist() -> None:
    names = {p.stem for p in RECIPES}
    assert {"math", "solver_verifier"} <= names


def test_unknown_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        Recipe.load(_write(tmp_path, {**MINIMAL, "trainer": {"stepz": 3}}))
    msg = str(exc.value)
    assert "trainer.stepz" in msg and "Extra inputs are not permitted" in msg
    assert str(tmp_path / "recipe.yaml") in msg


def test_unknown_top_level_section_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rl"):
        Recipe.load(_write(tmp_path, {**MINIMAL, "rl": {"steps": 3}}))


def test_bad_policy_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        Recipe.load(_write(tmp_path, {"policies": [{"name": "Bad.Name"}]}))
    assert "policies.0.name" in str(exc.value)


def test_duplicate_policy_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="policy names must be unique"):
        Recipe.load(_write(tmp_path, {"policies": [{"name": "a"}, {"name": "a"}]}))


def test_dataset_pool_not_in_pools(tmp_path: Path) -> None:
    data = {**MINIMAL, "dataset": {"pool": "gpu"}, "pools": [{"name": "cpu"}]}
    with pytest.raises(ConfigError) as exc:
        Recipe.load(_write(tmp_path, data))
    assert "dataset.pool 'gpu' is not one of the pools ['cpu']" in str(exc.value)


def test_sampling_for_unknown_policy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sampling names unknown policies"):
        Recipe.load(_write(tmp_path, {**MINIMAL, "sampling": {"ghost": {}}}))


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="recipe not found"):
        Recipe.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Recipe.load(bad)


def test_launcher_overrides_are_validated(tmp_path: Path) -> None:
    from astraflow.launcher.plan import effective_recipe

    recipe = Recipe.load(RECIPES[0])
    eff = effective_recipe(recipe, run_id="r1", steps=3, nodes={recipe.pools[0].name: 2})
    assert eff.run == "r1" and eff.trainer.steps == 3 and eff.pools[0].nodes == 2
    assert all(Path(p.model).is_absolute() for p in eff.policies)
    with pytest.raises(ValueError, match="unknown pools"):
        effective_recipe(recipe, run_id="r1", nodes={"nope": 1})
    with pytest.raises(ValueError):
        effective_recipe(recipe, run_id="r1", steps=0)
