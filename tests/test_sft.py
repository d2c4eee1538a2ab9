"""The warm start's progress in a log: a line every tenth of the way, the same training as the bar."""

from __future__ import annotations

from pathlib import Path

from astraflow.models import load_policy_model, load_policy_tokenizer
from astraflow.recipe import Recipe
from astraflow.recipe.data import recipe_dataset
from astraflow.sft import warm_start

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"


def test_warm_start_prints_progress_lines_when_not_a_terminal(capsys) -> None:
    recipe = Recipe.load(RECIPES / "math.yaml").localized()
    model, tokenizer = load_policy_model(recipe, "policy"), load_policy_tokenizer(recipe, "policy")
    figures = warm_start(model, tokenizer, recipe, "policy", dataset=recipe_dataset(recipe))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("SFT math/policy: step")]
    steps = figures["sft_steps"]
    assert len(lines) == 10 and lines[-1].startswith(f"SFT math/policy: step {steps}/{steps} loss ")
    assert figures["sft_final_loss"] < 3.0
