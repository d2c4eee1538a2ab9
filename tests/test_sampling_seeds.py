"""Seeded sampling (``SamplingParams.seed``, :mod:`astraflow.engines.seeding`): a seeded request's
tokens depend on its seed and the weights, not on the requests decoded beside it, the engine's own
seed or how it batches; an episode seeds its calls from the recipe's seed and its task."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from astraflow.engines import HFEngineConfig, SamplingParams, build_engine
from astraflow.engines.seeding import counter_uniforms, mix, row_keys
from astraflow.workflows.seeding import next_call_seed, seeded_episode

TEXTS = ["max 3 7 1 9 =", "min 4 2 =", "max 1 2 3 4 5 6 =", "min 8 8 1 2 3 4 5 6 7 ="]
NO_STOP = (-1,)
M64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    """splitmix64's finaliser on Python ints (the reference the tensor version must equal)."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


@pytest.fixture
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def test_counter_uniforms_are_splitmix64_of_key_and_step_and_uniform():
    keys = [0, 1, 12345, (1 << 62) + 7, mix("task", 3)]
    steps = [0, 5, 1, 4095, 17]
    got = counter_uniforms(torch.tensor(keys), torch.tensor(steps), torch.float64).tolist()
    want = [(splitmix64((splitmix64(k) + t) & M64) >> 11) * 2.0 ** -53 for k, t in zip(keys, steps, strict=True)]
    assert got == want
    u = counter_uniforms(torch.arange(200_000), torch.zeros(200_000, dtype=torch.long), torch.float64)
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert ((counts - 20_000).abs() < 600).all(), counts  # ~4 sigma of a binomial(200k, 0.1)


def test_row_keys_come_from_the_seed_or_the_merged_rows():
    assert row_keys(SamplingParams(), 2) == [None, None]
    assert row_keys(SamplingParams(seed=5), 2) == [mix(5, 0), mix(5, 1)] != row_keys(SamplingParams(seed=6), 2)
    assert row_keys(SamplingParams(row_seeds=(1, None)), 2) == [1, None]
    with pytest.raises(ValueError, match="row_seeds has 1 keys for 2 prompts"):
        row_keys(SamplingParams(row_seeds=(1,)), 2)
    # the seed is not compared: requests differing only in it are merged into one batch
    assert SamplingParams(seed=1) == SamplingParams(seed=2)


@pytest.mark.parametrize("batching", ["continuous", "request"])
def test_a_seeded_request_samples_the_same_tokens_whatever_decodes_beside_it(tiny_model, prompts, batching):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=NO_STOP, seed=42)
    alone = build_engine(HFEngineConfig(seed=1, batching=batching), tiny_model).generate([prompts[0], prompts[1]], params)
    other = build_engine(HFEngineConfig(seed=2, batching=batching), tiny_model)

    async def crowded():
        noise = SamplingParams(max_new_tokens=7, temperature=1.0, stop_token_ids=NO_STOP)
        return await asyncio.gather(other.agenerate([prompts[2]] * 3, noise),
                                    other.agenerate([prompts[0], prompts[1]], params),
                                    other.agenerate([prompts[3]], SamplingParams(max_new_tokens=9, seed=7,
                                                                                 stop_token_ids=NO_STOP)))

    _, beside, _ = asyncio.run(crowded())
    assert [g.token_ids for g in beside] == [g.token_ids for g in alone]
    assert beside[0].logprobs == pytest.approx(alone[0].logprobs, abs=1e-5)
    reseeded = build_engine({}, tiny_model).generate([prompts[0], prompts[1]], replace(params, seed=43))
    assert [g.token_ids for g in reseeded] != [g.token_ids for g in alone]  # another seed, other draws
    unseeded = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=NO_STOP)
    a = build_engine(HFEngineConfig(seed=1, batching=batching), tiny_model).generate([prompts[0]] * 4, unseeded)
    b = build_engine(HFEngineConfig(seed=2, batching=batching), tiny_model).generate([prompts[0]] * 4, unseeded)
    assert [g.token_ids for g in a] != [g.token_ids for g in b]  # unseeded: the engine's seed draws


def test_the_simulated_engine_honours_seeds():
    sim = {"type": "simulated", "tokens_per_s": 10_000, "median_tokens": 20}
    params = SamplingParams(max_new_tokens=50, seed=3)
    a = build_engine({**sim, "seed": 1}, None).generate([[1, 2]] * 2, params)
    b = build_engine({**sim, "seed": 2}, None).generate([[1, 2]] * 2, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b] and a[0].token_ids != a[1].token_ids


def test_an_episode_seeds_each_call_from_its_parts_and_the_call_index():
    assert next_call_seed() is None

    async def episode(task: str) -> list[int | None]:
        with seeded_episode(0, task):
            return [next_call_seed(), next_call_seed()]

    async def both():
        return await asyncio.gather(episode("t1"), episode("t2"), episode("t1"))

    t1, t2, again = asyncio.run(both())
    assert t1 == again and t1[0] != t1[1] and set(t1).isdisjoint(t2)
    assert next_call_seed() is None
