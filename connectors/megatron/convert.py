"""Hugging Face <-> Megatron-core weight names and layouts for Qwen2 and Llama decoder models.

Pure tensor re-arrangement (no Megatron import), so it is exact: every value is copied, never
recomputed, and HF -> Megatron -> HF gives back the same bytes. Megatron differs from HF in three
places:

* attention: one ``linear_qkv`` per layer, rows grouped per KV head ("query group"): for each group
  its ``heads / groups`` query heads, then its key head, then its value head (HF keeps ``q_proj``,
  ``k_proj``, ``v_proj`` apart); the same for the Qwen2 QKV bias;
* MLP: one ``linear_fc1`` = ``[gate_proj; up_proj]`` stacked by rows;
* norms: with Megatron's local layer spec the norms are modules of their own
  (``input_layernorm``, ``pre_mlp_layernorm``); with Transformer Engine's spec they are fused into the
  next linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``). Which one a model
  uses is read from its own keys (``norm_style``).

Tied embeddings: HF's checkpoint may or may not hold ``lm_head.weight``; Megatron holds only
``embedding.word_embeddings.weight`` when ``share_embeddings_and_output_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

SUPPORTED_ARCHS = ("qwen2", "llama")
NormStyle = Literal["local", "fused"]


@dataclass(frozen=True)
class DecoderShape:
    """The dimensions the conversion needs, read from an HF config (:meth:`from_hf_config`)."""

    arch: str
    layers: int
    heads: int
    groups: int
    """Key/value heads (Megatron's query groups)."""
    head_dim: int
    tied: bool
    """Input embedding and LM head share one matrix."""

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderShape:
        arch = getattr(config, "model_type", None)
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"megatron connector: model_type {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(arch=arch, layers=config.num_hidden_layers, heads=heads,
                   groups=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   tied=bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: DecoderShape) -> torch.Tensor:
    """HF q/k/v (weight ``[out, in]`` or bias ``[out]``) -> Megatron's per-group interleaved rows."""
    g, d = shape.groups, shape.head_dim
    tail = q.shape[1:]
    parts = (q.reshape(g, shape.q_per_group * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail).clone()


def _split_qkv(qkv: torch.Tensor, shape: DecoderShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = shape.groups, shape.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (shape.q_per_group + 2) * d, *tail)
    q, k, v = torch.split(grouped, [shape.q_per_group * d, d, d], dim=1)
    return (q.reshape(-1, *tail).clone(), k.reshape(-1, *tail).clone(), v.reshape(-1, *tail).clone())


def _norm_keys(i: int, style: NormStyle) -> tuple[str, str]:
    """Megatron names of layer ``i``'s (attention, MLP) input norms."""
    p = f"decoder.layers.{i}"
    if style == "fused":
        return f"{p}.self_attention.linear_qkv.layer_norm_weight", f"{p}.mlp.linear_fc1.layer_norm_weight"
    return f"{p}.input_layernorm.weight", f"{p}.pre_mlp_layernorm.weight"


def norm_style(megatron_keys: Iterable[str]) -> NormStyle:
    """Whether a Megatron model's norms are fused into its linears (Transformer Engine spec)."""
    return "fused" if any(k.endswith("linear_qkv.layer_norm_weight") for k in megatron_keys) else "local"


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: DecoderShape,
                   style: NormStyle = "local") -> dict[str, torch.Tensor]:
    """An HF state dict (``model.*`` / ``lm_head.weight`` names) as a Megatron ``GPTModel`` state dict."""
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
                                    "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not shape.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(shape.layers):
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        attn_norm, mlp_norm = _norm_keys(i, style)
        out[attn_norm] = hf[f"{h}.input_layernorm.weight"]
        out[mlp_norm] = hf[f"{h}.post_attention_layernorm.weight"]
        out[f"{m}.self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[f"{h}.self_attn.q_proj.weight"], hf[f"{h}.self_attn.k_proj.weight"],
            hf[f"{h}.self_attn.v_proj.weight"], shape)
        if f"{h}.self_attn.q_proj.bias" in hf:
            out[f"{m}.self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf[f"{h}.self_attn.q_proj.bias"], hf[f"{h}.self_attn.k_proj.bias"],
                hf[f"{h}.self_attn.v_proj.bias"], shape)
        out[f"{m}.self_attention.linear_proj.weight"] = hf[f"{h}.self_attn.o_proj.weight"]
        out[f"{m}.mlp.linear_fc1.weight"] = torch.cat(
            [hf[f"{h}.mlp.gate_proj.weight"], hf[f"{h}.mlp.up_proj.weight"]], dim=0)
        out[f"{m}.mlp.linear_fc2.weight"] = hf[f"{h}.mlp.down_proj.weight"]
    return out


def megatron_to_hf(mg: Mapping[str, Any], shape: DecoderShape) -> dict[str, torch.Tensor]:
    """A Megatron ``GPTModel`` state dict as HF names (the weight plane's names); Transformer
    Engine's ``_extra_state`` entries are dropped. Tied models get ``lm_head.weight`` too when the
    HF model lists it (it is the embedding matrix)."""
    style = norm_style(mg)
    emb = mg["embedding.word_embeddings.weight"]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb, "model.norm.weight": mg["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = emb if shape.tied else mg["output_layer.weight"]
    for i in range(shape.layers):
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        attn_norm, mlp_norm = _norm_keys(i, style)
        out[f"{h}.input_layernorm.weight"] = mg[attn_norm]
        out[f"{h}.post_attention_layernorm.weight"] = mg[mlp_norm]
        q, k, v = _split_qkv(mg[f"{m}.self_attention.linear_qkv.weight"], shape)
        out.update({f"{h}.self_attn.q_proj.weight": q, f"{h}.self_attn.k_proj.weight": k,
                    f"{h}.self_attn.v_proj.weight": v})
        if f"{m}.self_attention.linear_qkv.bias" in mg:
            qb, kb, vb = _split_qkv(mg[f"{m}.self_attention.linear_qkv.bias"], shape)
            out.update({f"{h}.self_attn.q_proj.bias": qb, f"{h}.self_attn.k_proj.bias": kb,
                        f"{h}.self_attn.v_proj.bias": vb})
        out[f"{h}.self_attn.o_proj.weight"] = mg[f"{m}.self_attention.linear_proj.weight"]
        gate, up = torch.chunk(mg[f"{m}.mlp.linear_fc1.weight"], 2, dim=0)
        out[f"{h}.mlp.gate_proj.weight"], out[f"{h}.mlp.up_proj.weight"] = gate.clone(), up.clone()
        out[f"{h}.mlp.down_proj.weight"] = mg[f"{m}.mlp.linear_fc2.weight"]
    return out
