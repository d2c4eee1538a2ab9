"""One pipeline stage's forward on a :class:`~connectors.megatron.batch.MicroBatch`: the first stage
embeds the token ids, a later one continues from the activations its schedule handed it
(``set_input_tensor``), and the last returns the response tokens' log-probs instead of logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from connectors.megatron.batch import MicroBatch
from connectors.megatron.logprobs import token_logprobs
from connectors.megatron.parallel import Ranks

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]
"""``loss_fn(scores) -> (loss, reduced)`` on the last stage (``scores``: :func:`split`): the loss to back-propagate and what the
step keeps of this forward (metrics, log-probs)."""


@dataclass(frozen=True)
class StageForward:
    ranks: Ranks
    temperature: float
    """The engines' sampling temperature: logits are divided by it."""
    vocab: int
    """The real vocabulary (the model's is padded to a multiple of tp)."""
    entropy_grad: bool = False
    """Back-propagate through the entropy (an entropy bonus); else it is a diagnostic only."""

    def __call__(self, model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
        """Hidden states ``[T, B, H]`` on an inner stage; on the last, ``[B, R, 2]``: each response
        token's log-prob and its position's entropy (:func:`split`)."""
        ids = micro.ids if self.ranks.first_stage else None
        out = model(ids, micro.positions, attention_mask=None)
        if not self.ranks.last_stage:
            return out
        logp, entropy = token_logprobs(out, micro.ids, micro.gather_pos, temperature=self.temperature,
                                       vocab=self.vocab, entropy_grad=self.entropy_grad)
        return torch.stack([logp, entropy], dim=-1)


def split(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's output as (log-probs ``[B, R]``, entropies ``[B, R]``)."""
    return scores[..., 0], scores[..., 1]
