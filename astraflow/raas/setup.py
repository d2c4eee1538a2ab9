"""What a node builds from a recipe: the workflow and one engine per policy."""

from __future__ import annotations

import inspect
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.engines import Engine
    from astraflow.recipe import PoolSpec, Recipe
    from astraflow.workflows import Workflow


def build_recipe_workflow(recipe: Recipe) -> Workflow:
    """The recipe's workflow; per-policy ``sampling`` of the recipe fills the workflow's sampling
    arguments (``sampling``, ``<role>_sampling``) that ``workflow.params`` leaves unset."""
    from astraflow.workflows import WORKFLOWS, build_workflow

    params: dict[str, Any] = dict(recipe.workflow.params)
    cls = WORKFLOWS.get(recipe.workflow.type) if recipe.workflow.type in WORKFLOWS else None
    if cls is not None and recipe.sampling:
        sig = inspect.signature(cls.__init__).parameters
        if "sampling" in sig and "sampling" not in params:
            policy = params.get("policy") or recipe.policies[0].name
            if policy in recipe.sampling:
                params["sampling"] = recipe.sampling[policy].model_dump()
        for name in sig:
            role = name.removesuffix("_sampling")
            if name.endswith("_sampling") and name not in params:
                policy = params.get(f"{role}_policy", role)
                if policy in recipe.sampling:
                    params[name] = recipe.sampling[policy].model_dump()
    return build_workflow(recipe.workflow.type, **params)


def build_policy_engines(recipe: Recipe, pool: PoolSpec, node_id: str) -> dict[str, Engine]:
    """One engine per recipe policy on a freshly built model; weights are loaded later from the
    weight plane. Each node samples with its own seed, so a task re-run elsewhere draws new samples."""
    from astraflow.engines import build_engine

    engine_cfg = pool.engine.model_copy(update={"seed": pool.engine.seed + zlib.crc32(node_id.encode()) % 100_000})
    engines = {}
    for policy in recipe.policies:
        model = recipe.build_policy_model(policy.name)
        engines[policy.name] = build_engine(engine_cfg, model, version=0)
    return engines
