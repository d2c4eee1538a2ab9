"""The HF engine's continuous batching: rows join the running batch between steps and leave the step
they end, with tokens, log-probs and versions meaning what they mean in ``generate``."""

from __future__ import annotations

import asyncio
import threading

import pytest
from run_records import teacher_forced

from astraflow.engines import FullState, HFEngineConfig, SamplingParams, build_engine

TEXTS = ["max 3 7 1 9 =", "min 4 2 =", "max 1 2 3 4 5 6 =", "min 8 8 1 2 3 4 5 6 7 ="]
NO_STOP = (-1,)


@pytest.fixture
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


class ForwardSpy:
    """Counts the rows of every forward of ``model`` (a prefill or a step) and runs ``hook`` before it."""

    def __init__(self, model, hook=None) -> None:
        self.rows: list[int] = []
        self.kinds: list[str] = []
        self._forward, self._hook = model.forward, hook
        model.forward = self

    def __call__(self, *args, **kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.rows.append(ids.shape[0])
        self.kinds.append("step" if ids.shape[1] == 1 else "prefill")
        if self._hook is not None:
            self._hook(len(self.rows))
        return self._forward(*args, **kwargs)


async def _staggered(eng, requests):
    """``(delay_steps, prompts, params)`` each submitted once the engine took ``delay_steps`` steps."""
    batcher = eng._batcher

    async def one(delay, prompts, params):
        while batcher.steps < delay:
            await asyncio.sleep(0.001)
        return await eng.agenerate(prompts, params)

    return await asyncio.gather(*(one(*r) for r in requests))


def test_greedy_rows_joining_mid_batch_decode_as_each_alone(tiny_model, prompts):
    """Requests of different prompt widths and lengths, joining a running batch at different steps,
    get exactly the tokens a batch of their own gives, and teacher-forced log-probs."""
    eng = build_engine({}, tiny_model)
    alone = build_engine(HFEngineConfig(batching="request"), tiny_model)
    requests = [(0, [prompts[0]] * 2, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=NO_STOP)),
                (3, [prompts[3]], SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=NO_STOP)),
                (5, [prompts[1], prompts[2]], SamplingParams(max_new_tokens=9, temperature=0.0,
                                                             stop_token_ids=NO_STOP))]
    spy = ForwardSpy(tiny_model)
    outs = asyncio.run(_staggered(eng, requests))
    # the later requests joined while the first ran: some step decoded rows of two requests at once
    assert max(spy.rows) >= 3 and spy.kinds.count("prefill") == 3, spy.rows
    for (_, rows, params), gens in zip(requests, outs, strict=True):
        for prompt, g in zip(rows, gens, strict=True):
            [ref] = alone.generate([prompt], params)
            assert g.token_ids == ref.token_ids and len(g.token_ids) == params.max_new_tokens
            assert g.finish_reason == "length"
            assert g.logprobs == pytest.approx(teacher_forced(tiny_model, prompt, g.token_ids), abs=1e-4)


def test_sampled_rows_carry_their_tempered_logprobs_and_rows_leave_when_they_end(tiny_model, prompts):
    eng = build_engine({"seed": 7}, tiny_model)
    spy = ForwardSpy(tiny_model)
    long = SamplingParams(max_new_tokens=10, temperature=0.7, stop_token_ids=NO_STOP)
    short = SamplingParams(max_new_tokens=2, temperature=1.0, stop_token_ids=NO_STOP)
    outs = asyncio.run(_staggered(eng, [(0, [prompts[2]], long), (0, [prompts[1]] * 3, short),
                                        (4, [prompts[0]], short)]))
    for (rows, params), gens in zip([([prompts[2]], long), ([prompts[1]] * 3, short), ([prompts[0]], short)], outs,
                                    strict=True):
        for prompt, g in zip(rows, gens, strict=True):
            assert len(g.token_ids) == params.max_new_tokens
            ref = teacher_forced(tiny_model, prompt, g.token_ids, params.temperature)
            assert g.logprobs == pytest.approx(ref, abs=1e-4)
    steps = [r for r, k in zip(spy.rows, spy.kinds, strict=True) if k == "step"]
    # 4 rows for the first step, then the short request's 3 rows leave: the long row decodes alone
    # until the late request joins (2 rows) and leaves again
    assert steps[0] == 4 and steps[1] == 1 and 2 in steps and steps[-1] == 1, steps


def test_a_stop_token_ends_a_row_and_the_others_go_on(tiny_model, prompts):
    eng = build_engine({}, tiny_model)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=NO_STOP)
    [first] = eng.generate([prompts[0]], greedy)
    stop_at = first.token_ids[2]  # the greedy row's third token: it must end there
    stopping = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop_at,))

    async def main():
        return await asyncio.gather(eng.agenerate([prompts[0]], stopping), eng.agenerate([prompts[2]], greedy))

    (a,), (b,) = asyncio.run(main())
    cut = first.token_ids.index(stop_at) + 1
    assert a.token_ids == first.token_ids[:cut] and a.finish_reason == "stop"
    assert len(b.token_ids) == 8 and b.finish_reason == "length"


def test_a_weight_swap_lands_between_steps_and_tags_later_tokens(tiny_model, prompts):
    eng = build_engine({}, tiny_model, version=1)
    state = {k: v + 0.01 for k, v in tiny_model.state_dict().items()}
    swap: dict = {}

    def hook(n):  # during the 3rd forward (the 2nd step) another thread swaps the weights
        if n == 3:
            swap["thread"] = t = threading.Thread(target=eng.update_weights, args=(FullState(state, 2),))
            t.start()
            t.join(timeout=0.2)
            assert t.is_alive()  # it waits for the step in flight

    ForwardSpy(tiny_model, hook)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=NO_STOP)
    outs = asyncio.run(_staggered(eng, [(0, [prompts[0], prompts[1]], params), (4, [prompts[2]], params)]))
    swap["thread"].join()
    assert [g.versions for g in outs[0]] == [[1, 1, 1, 2, 2]] * 2
    assert outs[1][0].versions == [2] * 5  # joined after the swap


def test_the_batch_never_exceeds_max_batch_size_and_a_larger_request_runs_alone(tiny_model, prompts):
    eng = build_engine(HFEngineConfig(max_batch_size=4), tiny_model)
    spy = ForwardSpy(tiny_model)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, stop_token_ids=NO_STOP)

    async def main():
        return await asyncio.gather(*(eng.agenerate([prompts[i % 4]] * n, params) for i, n in enumerate([2, 3, 6, 1])))

    outs = asyncio.run(main())
    assert [len(o) for o in outs] == [2, 3, 6, 1]
    steps = [r for r, k in zip(spy.rows, spy.kinds, strict=True) if k == "step"]
    assert 6 in steps and all(r <= 4 for r in steps if r != 6), steps


def test_a_failed_step_fails_its_requests_and_the_next_request_is_served(tiny_model, prompts):
    eng = build_engine({}, tiny_model)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=NO_STOP)

    def hook(n):
        if n == 2:
            raise RuntimeError("out of memory")

    ForwardSpy(tiny_model, hook)

    async def main():
        return await asyncio.gather(eng.agenerate([prompts[0]], params), eng.agenerate([prompts[1]] * 2, params),
                                    return_exceptions=True)

    outs = asyncio.run(main())
    assert all(isinstance(o, RuntimeError) and "out of memory" in str(o) for o in outs), outs
    [g] = asyncio.run(eng.agenerate([prompts[2]], params))
    assert len(g.token_ids) == 4


def test_a_cancelled_request_leaves_the_batch(tiny_model, prompts):
    eng = build_engine({}, tiny_model)
    spy = ForwardSpy(tiny_model)
    long = SamplingParams(max_new_tokens=30, temperature=1.0, stop_token_ids=NO_STOP)

    async def main():
        doomed = asyncio.ensure_future(eng.agenerate([prompts[0]] * 3, long))
        kept = asyncio.ensure_future(eng.agenerate([prompts[1]], long))
        while eng._batcher.steps < 3:
            await asyncio.sleep(0.001)
        doomed.cancel()
        return await kept

    [g] = asyncio.run(main())
    assert len(g.token_ids) == 30
    steps = [r for r, k in zip(spy.rows, spy.kinds, strict=True) if k == "step"]
    assert steps[0] == 4 and steps[-1] == 1, steps


def test_a_sliding_window_model_batches_per_request():
    """Rows move between batches by their caches' keys and values: a model whose cache has other layers
    (a sliding window keeps only its last window) falls back to request batching, said in the log."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32, vocab_size=64, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0)
    eng = build_engine({}, Qwen2ForCausalLM(config))
    assert eng.batching == "request"
    [g] = asyncio.run(eng.agenerate([[1, 2, 3]], SamplingParams(max_new_tokens=3, stop_token_ids=NO_STOP)))
    assert len(g.token_ids) == 3
