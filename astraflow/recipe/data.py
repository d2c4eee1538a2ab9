"""A recipe's data: its dataset, and the training tasks the dataflow emits from it.

Every user of a recipe's dataset (the dataflow's task stream, the SFT warm start, the demo's
held-out evaluation) builds it here, so they all draw from the same seeded dataset.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

from astraflow.tasks.base import Dataset, Problem, seeded_dataset

if TYPE_CHECKING:
    from astraflow.recipe import Recipe
    from astraflow.records import Task


def recipe_dataset(recipe: Recipe) -> Dataset:
    """The recipe's dataset, seeded with the recipe's seed unless its section sets one."""
    return seeded_dataset(recipe.dataset, recipe.seed)


def task_of(problem: Problem, recipe: Recipe, prompt_id: str | None = None) -> Task:
    """The Task for ``problem`` under the recipe's dataset section (a chat prompt travels as JSON
    in ``metadata["messages"]``, rendered by each policy's own chat template on the node)."""
    from astraflow.records import Task
    from astraflow.workflows.policy import MESSAGES_KEY

    spec = recipe.dataset
    metadata = dict(problem.metadata)
    if problem.messages:
        metadata[MESSAGES_KEY] = json.dumps([{"role": r, "content": c} for r, c in problem.messages])
    return Task(prompt_id=prompt_id or problem.prompt_id, prompt=problem.prompt, answer=problem.answer,
                samples=spec.samples, task_type=problem.task_type or spec.task_type, policy="",
                pool=spec.pool, metadata=metadata)


def recipe_tasks(recipe: Recipe) -> Iterator[Task]:
    """The recipe's training tasks: an endless, seeded stream of the dataset's train split, each draw
    with its own prompt id (a prompt drawn twice is two tasks)."""
    from astraflow.records.task import SOURCE_ID_KEY

    for i, problem in enumerate(recipe_dataset(recipe).stream("train", seed=recipe.seed)):
        task = task_of(problem, recipe, f"{problem.prompt_id}.{i}")
        task.metadata[SOURCE_ID_KEY] = problem.prompt_id  # per-prompt statistics: the problem, not the draw
        yield task
