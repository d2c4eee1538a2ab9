"""``decode: graphs``: the one-token step recorded once per bucket over fixed tensors and replayed.

On the CPU the recorder replays the step eagerly over the same fixed tensors, which drives the
bucketing, padding, cache copying, recording and weight-update logic the CUDA graphs rely on; the
CUDA test records real graphs where a GPU is present (scripts/device runs it on the GPU machine)."""

import threading

import pytest
import torch
from run_records import teacher_forced

from astraflow.engines import FullState, InPlacePatch, SamplingParams, build_engine
from astraflow.engines.graphs import EagerRecorder, GraphDecoder

TEXTS = ["max 3 7 1 9 =", "min 4 2 =", "max 1 2 3 4 5 6 ="]
FULL_LENGTH = (-1,)
"""Stop only on an impossible id, so every row decodes every step."""


class CountingRecorder(EagerRecorder):
    def __init__(self) -> None:
        self.recorded = 0

    def record(self, step):
        self.recorded += 1
        return super().record(step)


@pytest.fixture
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture
def make_engine(tiny_checkpoint):
    """``make_engine(decode, **options)``: an hf engine of a fresh copy of the tiny model; a graphs
    engine's recorder counts its recordings."""
    from astraflow.models import load_model

    def make(decode: str = "graphs", version: int = 0, **options):
        eng = build_engine({"decode": decode, "seed": 3, **options}, load_model(tiny_checkpoint), version=version)
        if decode == "graphs":
            eng._graphs.recorder = CountingRecorder()
        return eng

    return make


def test_buckets_round_rows_up_and_lengths_to_the_quantum():
    assert GraphDecoder.buckets(1, 10) == (1, 128)
    assert GraphDecoder.buckets(5, 129) == (8, 256)
    assert GraphDecoder.buckets(17, 100) == (24, 128)
    assert GraphDecoder.buckets(129, 300) == (160, 384)
    assert GraphDecoder.buckets(513, 10) == (1024, 128)  # beyond the largest: multiples of it


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padded_groups_decode_with_teacher_forced_logprobs(temperature, make_engine, prompts):
    eng = make_engine()
    rows = [prompts[0]] * 3 + [prompts[1]] * 2  # 5 rows in the 8-row bucket: 3 padding rows
    gens = eng.generate(rows, SamplingParams(max_new_tokens=6, temperature=temperature, stop_token_ids=FULL_LENGTH))
    assert eng._graphs.recorded == [(8, 128)] and eng._graphs.recorder.recorded == 1
    for prompt, g in zip(rows, gens, strict=True):
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) == 6 and g.finish_reason == "length"
        assert g.logprobs == pytest.approx(teacher_forced(eng.model, prompt, g.token_ids, temperature), abs=1e-4)
    assert len({tuple(g.token_ids) for g in gens[:3]}) > 1  # each row samples on its own


def test_graphs_and_eager_decode_the_same_greedy_tokens_and_stop_at_eos(make_engine, prompts):
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    graphs, eager = make_engine(), make_engine("eager")
    for g, e in zip(graphs.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert g.token_ids == e.token_ids and g.finish_reason == e.finish_reason
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)


def test_a_bucket_records_once_and_a_later_batch_reads_nothing_of_an_earlier_one(make_engine, prompts):
    eng, fresh = make_engine(), make_engine()
    params = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=FULL_LENGTH)
    eng.generate([prompts[2]] * 4, params)  # fills the (4, 128) slot's cache with another batch's keys
    second = eng.generate([prompts[1], prompts[0], prompts[1]], params)  # 3 rows: the same (4, 128) bucket
    assert eng._graphs.recorder.recorded == 1  # replayed, not recorded again
    for a, b in zip(second, fresh.generate([prompts[1], prompts[0], prompts[1]], params), strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    eng.generate([prompts[0]] * 9, params)  # a new bucket records its own step
    assert eng._graphs.recorded == [(4, 128), (16, 128)] and eng._graphs.recorder.recorded == 2


def test_slots_are_bounded_least_recently_used_first(make_engine, prompts):
    eng = make_engine()
    eng._graphs.max_slots = 2
    params = SamplingParams(max_new_tokens=2, temperature=0.0, stop_token_ids=FULL_LENGTH)
    for rows in (1, 2, 1, 4):
        eng.generate([prompts[0]] * rows, params)
    assert eng._graphs.recorded == [(1, 128), (4, 128)]


def test_weight_updates_land_in_the_tensors_the_recorded_steps_read(make_engine, prompts, tiny_checkpoint):
    """A full load and an in-place patch write into the parameters' own storage: the replayed step
    computes with the new weights, as an eager engine loaded with them does."""
    eng = make_engine()
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=FULL_LENGTH)
    eng.generate(prompts, params)  # records (4, 128)
    addresses = {k: t.data_ptr() for k, t in eng.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in eng.state_dict().items()}
    eng.update_weights(FullState(state, 1))
    assert {k: t.data_ptr() for k, t in eng.state_dict().items()} == addresses
    reference = make_engine("eager", version=1)
    reference.update_weights(FullState(state, 1))
    after = eng.generate(prompts, params)
    assert eng._graphs.recorder.recorded == 1
    for a, b in zip(after, reference.generate(prompts, params), strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert set(a.versions) == {1}
    name = "model.layers.0.mlp.down_proj.weight"
    patched = state[name].clone()
    patched[:, :4] = 0.0
    eng.update_weights(InPlacePatch(lambda tensors: tensors[name][:, :4].zero_(), 2))
    reference.update_weights(FullState({**state, name: patched}, 2))
    for a, b in zip(eng.generate(prompts, params), reference.generate(prompts, params), strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_swap_started_during_a_step_lands_before_the_next_one(make_engine, prompts):
    eng = make_engine(version=1)
    state = {k: v + 0.01 for k, v in eng.state_dict().items()}
    calls, original = {"n": 0}, eng.model.forward

    def forward(*a, **kw):  # during the 2nd decoding step, another thread swaps the weights
        calls["n"] += 1
        if calls["n"] == 4:  # the prefill, the 1st step's recording and its replay, then the 2nd step
            calls["thread"] = t = threading.Thread(target=eng.update_weights, args=(FullState(state, 2),))
            t.start()
            t.join(timeout=0.2)
            assert t.is_alive()  # it waits for the step in flight
        return original(*a, **kw)

    eng.model.forward = forward
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=5, stop_token_ids=FULL_LENGTH))
    calls["thread"].join()
    assert [g.versions for g in gens] == [[1, 1, 1, 2, 2]] * 3


def test_a_replaced_weight_tensor_is_refused_before_a_replay(make_engine, prompts):
    eng = make_engine()
    params = SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=FULL_LENGTH)
    eng.generate(prompts, params)
    eng.model.model.norm.weight.data = eng.model.model.norm.weight.data.clone()  # a new tensor, not written in place
    with pytest.raises(RuntimeError, match="replaced, not written in place"):
        eng.generate(prompts, params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by scripts/device on the GPU machine)")
def test_a_cuda_graphs_engine_decodes_as_the_cpu_engine(tiny_checkpoint, prompts):
    from astraflow.engines.graphs import CudaGraphRecorder
    from astraflow.models import load_model

    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=FULL_LENGTH)
    cpu = build_engine({"decode": "eager"}, load_model(tiny_checkpoint)).generate(prompts, params)
    cuda = build_engine({"device": "cuda", "decode": "graphs"}, load_model(tiny_checkpoint))
    assert isinstance(cuda._graphs.recorder, CudaGraphRecorder)
    for _ in range(2):  # the second batch replays the recorded graph
        for c, g in zip(cpu, cuda.generate(prompts, params), strict=True):
            assert c.token_ids == g.token_ids and c.logprobs == pytest.approx(g.logprobs, abs=1e-3)
    assert len(cuda._graphs.recorder.graphs) == 1
