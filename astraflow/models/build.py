"""Tiny Qwen2/Llama-architecture causal LMs built from a YAML config in the repo (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from astraflow.config import read_yaml_mapping

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ModelConfig(BaseModel):
    """Architecture of a small ``transformers`` causal LM; the vocabulary comes from the tokenizer."""

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
    max_position_embeddings: int = 64
    """Longest prompt + response the model serves."""
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


def build_model(config: ModelConfig | dict[str, Any] | str | Path) -> PreTrainedModel:
    """A freshly initialised causal LM (fp32, eval mode) for the project tokenizer, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from astraflow.models.tokenizer import build_tokenizer

    if isinstance(config, (str, Path)):
        config = ModelConfig.load(config)
    elif isinstance(config, dict):
        config = ModelConfig.model_validate(config)
    tok = build_tokenizer()
    hf_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if config.arch == "qwen2" else (
        LlamaConfig, LlamaForCausalLM)
    hf_config = hf_cls(
        vocab_size=len(tok),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        attn_implementation="sdpa",
    )
    # The global RNG is used by transformers' initialisers; restore it so building a model has no
    # side effect on the caller's sampling.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(config.seed)
        model = model_cls(hf_config)
    finally:
        torch.random.set_rng_state(state)
    return model.float().eval()
