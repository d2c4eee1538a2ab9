"""The Megatron-core trainer backend: the built-in backend's GRPO/PPO step and AdamW, on a Megatron
``GPTModel`` whose weights come from (and are published as) the policy's HF checkpoint.

Only what differs from :class:`~astraflow.trainer.torch_backend.TorchBackend` is here: the model is
converted HF -> Megatron once at start, logits come from ``GPTModel.forward``, and ``state_dict`` /
``load_state`` speak HF names (:mod:`connectors.megatron.convert`), so checkpoints, deltas and the
engines are the same as with the built-in backend.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from astraflow.trainer.torch_backend import TorchBackend
from connectors.megatron.config import MegatronBackendConfig
from connectors.megatron.convert import DecoderShape, hf_to_megatron, megatron_to_hf, norm_style
from connectors.megatron.model import build_gpt_model, ensure_model_parallel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def load_hf_weights(gpt: torch.nn.Module, hf_state: dict[str, torch.Tensor], shape: DecoderShape) -> None:
    """Copy HF-named weights into a ``GPTModel``; every Megatron parameter must be set."""
    converted = hf_to_megatron(hf_state, shape, norm_style(gpt.state_dict()))
    missing, unexpected = gpt.load_state_dict(converted, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]  # Transformer Engine metadata
    if missing or unexpected:
        raise ValueError(f"megatron connector: HF -> Megatron conversion left missing={missing} "
                         f"unexpected={unexpected}")


class MegatronBackend(TorchBackend):
    """GRPO/PPO with AdamW on a Megatron-core ``GPTModel`` (fp32 master weights), one rank."""

    def __init__(self, model: PreTrainedModel, config: MegatronBackendConfig | dict[str, Any] | None = None) -> None:
        if not isinstance(config, MegatronBackendConfig):
            config = MegatronBackendConfig.model_validate(config or {})
        device = torch.device(config.device)
        ensure_model_parallel(device)
        self.shape = DecoderShape.from_hf_config(model.config)
        hf_state = {k: v.detach().float() for k, v in model.state_dict().items()}
        self.hf_keys = list(hf_state)
        """The names the HF model publishes (tied models list ``lm_head.weight`` or not, as HF does)."""
        gpt = build_gpt_model(model.config, device)
        load_hf_weights(gpt, hf_state, self.shape)
        super().__init__(gpt, config)
        log.info("megatron backend: Megatron-core GPTModel (%s, %d layers, %d/%d heads, %.1f M parameters) on %s",
                 self.shape.arch, self.shape.layers, self.shape.heads, self.shape.groups,
                 sum(p.numel() for p in gpt.parameters()) / 1e6, device)

    def logits(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.model(ids, positions, attention_mask=None)

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        hf = megatron_to_hf(self.model.state_dict(), self.shape)
        out = {k: hf[k].detach().to("cpu", copy=True) for k in self.hf_keys}
        return {k: v.to(dtype) for k, v in out.items()} if dtype is not None else out

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        with torch.no_grad():
            load_hf_weights(self.model, {k: torch.as_tensor(v).float() for k, v in model_state.items()}, self.shape)
        if optimizer_state is not None:
            import copy

            self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
