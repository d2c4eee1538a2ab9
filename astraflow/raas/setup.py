"""What a node builds from a recipe: the workflow and a policy client (engine + tokenizer) per policy."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.recipe import PoolSpec, Recipe
    from astraflow.workflows import PolicyClient, Workflow


def build_recipe_workflow(recipe: Recipe) -> Workflow:
    """The recipe's workflow (its options were validated when the recipe loaded)."""
    from astraflow.workflows import build_workflow

    return build_workflow(recipe.workflow)


def end_of_turn_ids(model: Any) -> tuple[int, ...]:
    """The checkpoint's end-of-turn tokens from its generation config (an id or a list of ids)."""
    gen = getattr(model, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None) if gen is not None else None
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def build_policy_clients(recipe: Recipe, pool: PoolSpec, node_id: str,
                         policies: list[str] | None = None) -> dict[str, PolicyClient]:
    """One client per policy the workflow calls (all of the recipe's by default): the policy's
    checkpoint served by the pool's engine, its own tokenizer, its sampling settings. Weights are
    replaced later from the weight plane. Episodes seed their own requests (the recipe's seed and
    the task: :mod:`astraflow.workflows.seeding`), so a task samples the same tokens on any node; the
    node's own seed draws only for unseeded requests (a workflow's calls outside an episode)."""
    from astraflow.engines import build_engine
    from astraflow.models import load_policy_model, load_policy_tokenizer
    from astraflow.workflows.policy import policy_client

    seed = pool.engine.seed + zlib.crc32(node_id.encode()) % 100_000
    engine_cfg = pool.engine.model_copy(update={"seed": seed})
    out = {}
    for name in policies or [p.name for p in recipe.policies]:
        model = load_policy_model(recipe, name)
        tokenizer = load_policy_tokenizer(recipe, name)
        out[name] = policy_client(name, build_engine(engine_cfg, model, version=0), tokenizer,
                                  recipe.sampling_for(name), getattr(model.config, "max_position_embeddings", None),
                                  end_of_turn_ids(model))
    return out
