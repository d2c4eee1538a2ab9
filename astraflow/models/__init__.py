"""Tiny causal LMs and the in-code tokenizer (no download)."""

from astraflow.models.build import ModelConfig, build_model
from astraflow.models.tokenizer import NO, YES, build_tokenizer, compact

__all__ = ["NO", "YES", "ModelConfig", "build_model", "build_tokenizer", "compact"]
