"""``astraflow run`` notes a pool with fewer episode slots than the tasks an async dataflow keeps out:
the next batch's tasks would wait in the topic (the demo recipes were sized so)."""

from pathlib import Path

from astraflow.launcher.plan import slot_shortfall
from astraflow.recipe import Recipe

RECIPES = Path(__file__).parent.parent / "examples" / "recipes"


def _pool(recipe: Recipe, **update) -> Recipe:
    pools = [p.model_copy(update=update) for p in recipe.pools]
    return Recipe.model_validate(recipe.model_copy(update={"pools": pools}).model_dump())


def test_the_demo_recipes_have_a_slot_per_task_in_flight():
    for name in ("math", "solver_verifier", "calc_agent", "jsonl_math"):
        assert slot_shortfall(Recipe.load(RECIPES / f"{name}.yaml")) is None, name


def test_too_few_slots_are_named_with_the_counts():
    recipe = Recipe.load(RECIPES / "math.yaml")  # 16 groups per batch, max_staleness 1: 32 tasks out
    hint = slot_shortfall(_pool(recipe, concurrency=16))
    assert hint is not None and "16 episode slots" in hint and "up to 32 tasks" in hint
    assert slot_shortfall(_pool(recipe, concurrency=16, nodes=2)) is None  # slots are nodes x concurrency


def test_sync_mode_needs_a_wave():
    recipe = Recipe.load(RECIPES / "math.yaml")
    sync = recipe.model_copy(update={"dataflow": recipe.dataflow.model_copy(update={"mode": "sync"})})
    assert slot_shortfall(_pool(sync, concurrency=16)) is None  # a wave is groups_per_batch = 16 tasks
    assert "up to 16 tasks out (a sync wave)" in slot_shortfall(_pool(sync, concurrency=8))
