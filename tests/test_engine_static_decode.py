"""The hf engine's static path (a static KV cache, the decode step compiled by torch.compile) means
what the eager path means: log-probs of the tempered softmax, per-token versions, swaps between
steps, patches in place into the tensors the compiled step reads, nothing kept of an earlier batch.

On the CPU the compiled step runs through inductor's C++ code (the GPU's CUDA graphs need a GPU:
``test_a_cuda_static_engine_*`` runs where one is present)."""

import threading

import pytest
import torch
from run_records import teacher_forced

from astraflow.engines import FullState, InPlacePatch, SamplingParams, build_engine
from astraflow.engines.decoding import StaticDecoder

TEXTS = ["max 3 7 1 9 =", "min 4 2 =", "max 1 2 3 4 5 6 ="]
FULL_LENGTH = (-1,)
"""Stop only on an impossible id, so every row decodes every step (left padding exercised)."""


@pytest.fixture
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture
def make_engine(tiny_checkpoint):
    """``make_engine(decode, **options)``: an hf engine of a fresh copy of the tiny model."""
    from astraflow.models import load_model

    def make(decode: str, version: int = 0, **options):
        return build_engine({"decode": decode, "seed": 3, **options}, load_model(tiny_checkpoint), version=version)

    return make


def _flat(rows) -> list[float]:
    return [x for row in rows for x in row]


def _perturbed(state: dict, scale: float = 0.05) -> dict:
    gen = torch.Generator().manual_seed(1)
    return {k: v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_static_logprobs_match_forward_recomputation_for_groups_of_shared_prompts(temperature, make_engine, prompts):
    eng = make_engine("static")
    assert eng.decode == "static"
    rows = [prompts[0]] * 4 + [prompts[1]] * 3 + [prompts[2]]  # 8 rows, 3 distinct prompts: shared prefill
    gens = eng.generate(rows, SamplingParams(max_new_tokens=6, temperature=temperature, stop_token_ids=FULL_LENGTH))
    for prompt, g in zip(rows, gens, strict=True):
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) == 6 and g.finish_reason == "length"
        assert g.logprobs == pytest.approx(teacher_forced(eng.model, prompt, g.token_ids, temperature), abs=1e-4)
    assert len({tuple(g.token_ids) for g in gens[:4]}) > 1  # each row samples on its own


def test_static_and_eager_decode_the_same_greedy_tokens_and_stop_at_eos(make_engine, prompts, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    eager, static = make_engine("eager").generate(prompts, params), make_engine("static").generate(prompts, params)
    for e, s in zip(eager, static, strict=True):
        assert s.token_ids == e.token_ids and s.finish_reason == e.finish_reason
        assert s.logprobs == pytest.approx(e.logprobs, abs=1e-4)


def test_a_second_batch_reads_nothing_of_the_first(make_engine, prompts):
    """Both batches fall in one bucket, so they share one static cache (reset in between)."""
    params = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=FULL_LENGTH)
    used = make_engine("static")
    used.generate([p + p for p in prompts], params)  # longer prompts: stale entries beyond the next ones
    second = used.generate(prompts, params)
    fresh = make_engine("static").generate(prompts, params)
    assert len(used._static._caches) == 1
    for a, b in zip(second, fresh, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_patch_in_place_reaches_the_compiled_step(make_engine, prompts):
    """After the step is compiled, weights written into the model's own tensors are what it computes with."""
    params = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=FULL_LENGTH)
    static, eager = make_engine("static"), make_engine("eager")
    before = static.generate(prompts, params)
    new = _perturbed(static.state_dict())

    def write(tensors):
        for name, value in new.items():
            tensors[name].copy_(value)

    static.update_weights(InPlacePatch(write, 4))
    eager.update_weights(FullState(new, 4))
    after, expected = static.generate(prompts, params), eager.generate(prompts, params)
    assert _flat(g.logprobs for g in after) != pytest.approx(_flat(g.logprobs for g in before), abs=1e-3)
    for a, e in zip(after, expected, strict=True):
        assert a.versions == [4] * 5
        assert a.token_ids == e.token_ids and a.logprobs == pytest.approx(e.logprobs, abs=1e-4)


def _swap_during_step(eng, update, at_step: int):
    """Make ``eng`` start ``update`` from another thread while its ``at_step``-th decoding step runs,
    and check the swap waits for that step."""
    make_session, seen = eng._session, {}

    def session(*args):
        s = make_session(*args)
        step = s.step

        def stepping(tokens):
            seen["n"] = seen.get("n", 0) + 1
            if seen["n"] == at_step:
                seen["thread"] = t = threading.Thread(target=eng.update_weights, args=(update,))
                t.start()
                t.join(timeout=0.2)
                assert t.is_alive()  # held back by the step in flight
            return step(tokens)

        s.step = stepping
        return s

    eng._session = session
    return seen


def test_a_swap_lands_between_steps_the_same_way_in_both_paths(make_engine, prompts):
    params = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=FULL_LENGTH)
    unswapped = make_engine("static", version=1).generate(prompts, params)
    results = {}
    for decode in ("eager", "static"):
        eng = make_engine(decode, version=1)
        seen = _swap_during_step(eng, FullState(_perturbed(eng.state_dict()), 2), at_step=2)
        results[decode] = eng.generate(prompts, params)
        seen["thread"].join()
    for e, s, u in zip(results["eager"], results["static"], unswapped, strict=True):
        assert e.versions == s.versions == [1, 1, 1, 2, 2]  # prefill + 2 steps on version 1
        assert s.token_ids == e.token_ids and s.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        assert s.logprobs[:3] == pytest.approx(u.logprobs[:3], abs=1e-4)
    assert _flat(s.logprobs[3:] for s in results["static"]) != pytest.approx(_flat(u.logprobs[3:] for u in unswapped),
                                                                         abs=1e-3)


def test_the_eager_path_is_the_default_and_buckets_round_up(make_engine):
    assert make_engine(decode="eager").decode == "eager"
    assert build_engine({}, make_engine("eager").model).decode == "eager"
    assert StaticDecoder.buckets(3, 40) == (4, 128)
    assert StaticDecoder.buckets(33, 129) == (48, 256)
    assert StaticDecoder.buckets(128, 228) == (128, 256)
    assert StaticDecoder.buckets(600, 10) == (1024, 128)


def test_one_compile_serves_every_bucket_of_two_rows_or_more(make_engine, prompts):
    """Prompt widths, rows buckets and length buckets all change from batch to batch in a run: the
    step is compiled once for all of them (rows and length marked dynamic); a 1-row batch once more
    (torch specialises sizes of 1); the 4 most recently used caches are kept."""
    from torch._dynamo.utils import counters

    eng = make_engine("static", compile_backend="eager")  # the guards are dynamo's whatever the backend
    params = SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=FULL_LENGTH)
    counters.clear()
    for rows in (prompts, [p + p for p in prompts], [prompts[0]] * 9, prompts * 5, [prompts[2] * 12] * 6,
                 [prompts[1]] * 2, [prompts[2] * 12] * 40):
        eng.generate(rows, params)
    assert counters["stats"]["unique_graphs"] == 1
    eng.generate([prompts[0]], params)
    assert counters["stats"]["unique_graphs"] == 2
    assert len(eng._static._caches) == 4  # (4, 128), (16, 128), (8, 256), (2, 128), (48, 256), (1, 128)


def test_a_model_with_sliding_window_layers_is_refused_for_static_decoding():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                      max_window_layers=0, layer_types=["sliding_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="full-attention models only; Qwen2ForCausalLM has StaticSlidingWindowLayer"):
        build_engine({"decode": "static"}, Qwen2ForCausalLM(cfg))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by scripts/device on the GPU machine)")
def test_a_cuda_static_engine_decodes_as_the_cpu_engine_with_cuda_graphs(tiny_checkpoint, prompts):
    from astraflow.models import load_model

    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=FULL_LENGTH)
    cpu = build_engine({"decode": "eager"}, load_model(tiny_checkpoint)).generate(prompts, params)
    cuda = build_engine({"device": "cuda", "decode": "static"}, load_model(tiny_checkpoint))
    assert cuda.decode == "static"
    for _ in range(2):  # the second call replays the captured graph
        for c, g in zip(cpu, cuda.generate(prompts, params), strict=True):
            assert g.token_ids == c.token_ids and g.logprobs == pytest.approx(c.logprobs, abs=1e-3)


def test_every_batch_decodes_on_the_decoders_own_thread(make_engine, prompts):
    """CUDA graphs are kept per thread: calls from several threads must not each record their own."""
    eng = make_engine("static")
    threads, step = set(), eng._static._step

    def recording(**inputs):
        threads.add(threading.current_thread().name)
        return step(**inputs)

    eng._static._step = recording
    params = SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=FULL_LENGTH)
    caller = threading.Thread(target=eng.generate, args=(prompts, params))
    caller.start()
    caller.join()
    eng.generate(prompts, params)
    assert len(threads) == 1 and threads.pop().startswith("hf-static-decode")
