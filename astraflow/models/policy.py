"""A recipe's policy as a model: its checkpoint resolved to a local directory, loaded with
``AutoModelForCausalLM`` / ``AutoTokenizer``. The recipe names the source; building is done here, so
that loading a recipe never imports torch or transformers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.models.checkpoint import load_model, load_tokenizer, resolve_checkpoint

if TYPE_CHECKING:
    from astraflow.recipe import Recipe


def policy_checkpoint_dir(recipe: Recipe, policy: str) -> Path:
    """Local checkpoint directory of ``policy`` (downloaded / converted / built once)."""
    base = recipe.source.parent if recipe.source is not None else None
    return resolve_checkpoint(recipe.policy(policy).model, base=base)


def load_policy_model(recipe: Recipe, policy: str) -> Any:
    """``policy``'s model, loaded from its checkpoint."""
    return load_model(policy_checkpoint_dir(recipe, policy), trust_remote_code=recipe.policy(policy).trust_remote_code)


def load_policy_tokenizer(recipe: Recipe, policy: str) -> Any:
    """``policy``'s tokenizer, loaded from its checkpoint."""
    return load_tokenizer(policy_checkpoint_dir(recipe, policy),
                          trust_remote_code=recipe.policy(policy).trust_remote_code)
