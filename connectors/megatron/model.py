"""A Megatron-core ``GPTModel`` shaped like an HF Qwen2 / Llama checkpoint, on CPU or CUDA.

Built from Megatron's *local* layer spec (no Transformer Engine or Apex, which have no CPU build),
with two seams where megatron-core 0.16 assumes CUDA:

* core attention: the spec's ``core_attention`` is :class:`SDPACoreAttention` (PyTorch's
  ``scaled_dot_product_attention``, causal, grouped-query), because Megatron's local
  ``DotProductAttention`` takes its scratch buffer from a global CUDA memory buffer;
* rotary embedding: on CPU the module's class becomes :class:`_HostRotaryEmbedding`, whose only
  difference is that it does not move ``inv_freq`` to ``torch.cuda.current_device()``.

Everything else (embedding, QKV / MLP linears, RMSNorm, RoPE, output layer) is Megatron's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from connectors.megatron.shard import Layout, tp_split


class SDPACoreAttention(MegatronModule):
    """Causal grouped-query attention with ``torch.nn.functional.scaled_dot_product_attention``, in
    the place (and with the call signature) of Megatron's ``DotProductAttention``. Sequences are
    right-padded, so a causal mask is the whole mask: padding never precedes a real token."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 **_: Any) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences are not supported")
        # Megatron passes [seq, batch, heads, head_dim]; SDPA wants [batch, heads, seq, head_dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


class _HostRotaryEmbedding(RotaryEmbedding):
    """Megatron's rotary embedding, less its move of ``inv_freq`` to the current CUDA device."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


ONE_RANK = Layout()
"""tp = pp = 1."""


def transformer_config(hf_config: Any, layout: Layout = ONE_RANK, *,
                       params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """Megatron's config for the decoder described by an HF Qwen2 / Llama config, split by ``layout``."""
    heads = hf_config.num_attention_heads
    return TransformerConfig(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        pipeline_dtype=params_dtype if layout.pp > 1 else None,
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn_hidden_size=hf_config.intermediate_size, normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=params_dtype, use_cpu_initialization=True,
        perform_initialization=False,  # every weight is overwritten by the checkpoint's
        # The fused kernels are CUDA (Apex / TE) kernels; the unfused paths are the same math.
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)


def _rope_base(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10_000.0)


def build_gpt_model(hf_config: Any, device: torch.device, layout: Layout = ONE_RANK) -> GPTModel:
    """An (uninitialised-weights) ``GPTModel`` with the shapes of ``hf_config``'s decoder on ``device``:
    this rank's part of it under ``layout`` (Megatron's parallel state must be initialised with the
    same sizes, :func:`connectors.megatron.parallel.init_parallel`). Its logits stay split over the
    tensor-parallel ranks (``parallel_output``), vocabulary padded to a multiple of ``layout.tp``."""
    from megatron.core import parallel_state

    scaling = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if scaling not in ("default", None):
        raise ValueError(f"megatron connector: rope scaling {scaling!r} is not supported (only the default RoPE)")
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(config=transformer_config(hf_config, layout), transformer_layer_spec=spec,
                     vocab_size=layout.padded_vocab(hf_config.vocab_size),
                     max_sequence_length=hf_config.max_position_embeddings,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     position_embedding_type="rope", rotary_base=_rope_base(hf_config),
                     share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)))
    if device.type != "cuda":
        model.rotary_pos_emb.__class__ = _HostRotaryEmbedding  # every stage has one
    mark_tensor_parallel(model)
    return model.to(device)


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Tag each split weight as Megatron's initialisers would have (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``). megatron-core 0.16 tags a parallel layer's weight only
    inside its initialiser, which ``perform_initialization=False`` skips (only the biases get tagged);
    untagged, a split weight counts as a duplicate of tensor-parallel rank 0's in the gradient norm
    (``param_is_not_tensor_parallel_duplicate``), and the clip would see only part of the gradient."""
    for name, param in model.named_parameters():
        split = tp_split(name)
        if split is not None and not getattr(param, "tensor_model_parallel", False):
            param.tensor_model_parallel = True
            param.partition_dim = 1 if split == "cols" else 0
            param.partition_stride = 1
