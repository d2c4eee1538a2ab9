"""A recipe's data: its dataset, and the training tasks the dataflow emits from it.

Every user of a recipe's dataset (the dataflow's task stream, the SFT warm start, the demo's
held-out evaluation) builds it here, so they all draw from the same seeded dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from astraflow.tasks.base import Dataset, build_dataset

if TYPE_CHECKING:
    from astraflow.recipe import Recipe
    from astraflow.records import Task


def recipe_dataset(recipe: Recipe) -> Dataset:
    """The recipe's dataset, seeded with the recipe's seed unless its ``params`` set one."""
    spec = recipe.dataset
    return build_dataset(spec.type, **{"seed": recipe.seed, **spec.params})


def recipe_tasks(recipe: Recipe) -> Iterator[Task]:
    """The recipe's training tasks: an endless, seeded stream of the dataset's train split, each draw
    with its own prompt id (a prompt drawn twice is two tasks)."""
    from astraflow.records import Task

    spec = recipe.dataset
    for i, problem in enumerate(recipe_dataset(recipe).stream("train", seed=recipe.seed)):
        yield Task(prompt_id=f"{problem.prompt_id}.{i}", prompt=problem.prompt, answer=problem.answer,
                   samples=spec.samples, task_type=spec.task_type, policy="", pool=spec.pool)
