"""A policy's model: any checkpoint source resolved to a local Hugging Face directory and loaded
with ``AutoModelForCausalLM`` / ``AutoTokenizer``; the demo's tiny model is materialised as one."""

from astraflow.models.build import ModelConfig
from astraflow.models.checkpoint import (
    cache_root,
    check_checkpoint_dir,
    check_model_source,
    load_model,
    load_tokenizer,
    resolve_checkpoint,
)
from astraflow.models.export import export_checkpoint
from astraflow.models.policy import load_policy_model, load_policy_tokenizer, policy_checkpoint_dir

__all__ = ["ModelConfig", "cache_root", "check_checkpoint_dir", "check_model_source",
           "export_checkpoint", "load_model", "load_policy_model", "load_policy_tokenizer", "load_tokenizer",
           "policy_checkpoint_dir", "resolve_checkpoint"]
