"""The spec of a tiny Qwen2/Llama-architecture causal LM (``examples/models/tiny.yaml``), materialised
as a checkpoint directory by :mod:`astraflow.models.tiny`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from astraflow.config import read_yaml_mapping


class ModelConfig(BaseModel):
    """Architecture of a small ``transformers`` causal LM and the size of its tokenizer."""

    model_config = ConfigDict(extra="forbid")

    arch: Literal["qwen2", "llama"] = "qwen2"
    """Which ``transformers`` architecture to instantiate (Qwen2ForCausalLM or LlamaForCausalLM)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of decoder blocks."""
    num_heads: int = 4
    """Attention (query) heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when below num_heads)."""
    intermediate_size: int = 256
    """Width of the MLP."""
    max_position_embeddings: int = 256
    """Longest prompt + response the model serves (multi-turn tool episodes need ~150 tokens)."""
    vocab_size: int = 1024
    """Target size of the byte-level BPE vocabulary trained in code (special tokens included)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    tie_word_embeddings: bool = True
    """Share input embeddings and LM head (fewer parameters, smaller weight deltas)."""
    seed: int = 0
    """Seed of the random initialisation: the same config and seed give bit-identical weights."""

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        """A model config YAML (the fields at the top, or under ``model:``); a missing file or one
        that is not a YAML mapping is a ``ConfigError`` naming it."""
        data = read_yaml_mapping(Path(path), "model config")
        return cls.model_validate(data.get("model", data))
