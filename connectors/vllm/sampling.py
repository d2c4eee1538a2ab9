"""What the vLLM engines (in-process and server) accept of a generation request, and its stops."""

from __future__ import annotations

from astraflow.engines.base import SamplingParams


def check_request(prompts: list[list[int]], params: SamplingParams, engine: str) -> None:
    """Refuse what vLLM would serve differently from the trainer's assumptions (ValueError)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
    if params.top_p < 1.0:
        raise ValueError(f"the {engine} engine serves top_p = 1 only (got {params.top_p}): vLLM reports log-probs "
                         "renormalised over the top-p nucleus, not under the full tempered softmax the "
                         "trainer recomputes; use top_p: 1 or the hf engine")


def stop_ids(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    """The tokens that end a continuation: the request's, else the checkpoint's EOS (vLLM is told to
    ignore its own EOS, so these are the only stops; the stop token is kept, as in the hf engine)."""
    stops = params.stop_token_ids if params.stop_token_ids is not None else (eos_token_id,)
    return [s for s in stops if s is not None]
