"""Log-probabilities of the response tokens from logits split over the tensor-parallel ranks, with
Megatron's ``vocab_parallel_cross_entropy`` (each rank holds ``V / tp`` vocabulary columns; the
softmax's max and sum are all-reduced over the tensor-parallel group, so no rank ever holds the whole
``[B, T, V]``).
"""

from __future__ import annotations

import torch


def _mask_padding(local: torch.Tensor, vocab: int) -> torch.Tensor:
    """``-inf`` in the columns past the real vocabulary (Megatron pads it to a multiple of tp): the
    padded rows of the output layer are zero, and a zero logit would take probability mass."""
    from megatron.core import parallel_state as ps

    width = local.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    if start + width <= vocab:
        return local
    padded = torch.arange(start, start + width, device=local.device) >= vocab
    return local.masked_fill(padded, float("-inf"))


def token_logprobs(local_logits: torch.Tensor, ids: torch.Tensor, gather_pos: torch.Tensor, *,
                   temperature: float, vocab: int, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(response token), ``[B, T_resp]``: the logits at ``gather_pos`` predict ``ids`` at
    ``gather_pos + 1`` (the built-in backend's ``token_logprobs``, with the vocabulary split); and the
    entropy of each of those positions' distributions (with gradient only if ``entropy_grad``)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    rows = local_logits.gather(1, gather_pos[:, :, None].expand(-1, -1, local_logits.shape[-1]))
    rows = _mask_padding(rows.float() / temperature, vocab)
    if entropy_grad:
        entropy = _entropy(rows)
    else:  # a diagnostic: one row at a time, so its temporaries are [T_resp, V / tp], not [B, T_resp, V / tp]
        with torch.no_grad():
            entropy = torch.stack([_entropy(row) for row in rows])
    targets = ids.gather(1, (gather_pos + 1).clamp(max=ids.shape[1] - 1))
    # after the entropy: Megatron's cross entropy shifts its input in place
    return -vocab_parallel_cross_entropy(rows, targets), entropy


def _entropy(rows: torch.Tensor) -> torch.Tensor:
    """``H = log Z - sum_v p_v x_v`` over the whole vocabulary from this rank's columns: the max and the
    two sums are all-reduced over the tensor-parallel group (the sums with Megatron's autograd-aware
    reduction, whose backward passes the gradient through; the max is a constant shift)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_sum

    top = rows.detach().max(dim=-1).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = rows - top[..., None]
    e = torch.exp(shifted)
    z = reduce_sum(e.sum(-1))
    finite = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))  # 0 * -inf is nan
    return torch.log(z) - reduce_sum((e * finite).sum(-1)) / z


def full_logits(local_logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The whole ``[B, T, V]`` logits on every tensor-parallel rank, without gradient (for checks).
    torch's ``all_gather``: Megatron's ``gather_from_tensor_model_parallel_region`` allocates its
    output on ``torch.cuda.current_device()``, which a CPU host does not have."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    local = local_logits.detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    return torch.cat(pieces, dim=-1)[..., :vocab]
