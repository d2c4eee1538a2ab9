"""HFEngine: behaviour log-probs match a recomputation from the forward pass; per-token versions."""

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from astraflow.engines import FullState, InPlacePatch, SamplingParams, build_engine
from astraflow.models import load_model

TEXTS = ["max 3 7 1 9 =", "min 4 2 =", "max 1 2 3 4 5 6 ="]


@pytest.fixture
def prompts(tiny_tokenizer):
    """Three prompts of different lengths (left padding exercised)."""
    return [tiny_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def _recompute(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(tokens)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_forward_recomputation(temperature, tiny_model, prompts):
    model = tiny_model
    eng = build_engine({"seed": 3}, model)
    # stop only on an impossible id so every row generates the full length (left padding exercised)
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=6, temperature=temperature,
                                                stop_token_ids=(-1,)))
    for prompt, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) == 6
        assert g.finish_reason == "length"
        ref = _recompute(model, prompt, g.token_ids, temperature)
        assert g.logprobs == pytest.approx(ref, abs=1e-4)


def test_a_groups_shared_prompt_is_prefilled_once_and_each_row_samples_on_its_own(tiny_model, prompts):
    eng = build_engine({"seed": 5}, tiny_model)
    batches: list[int] = []
    forward = tiny_model.forward

    def counting(*args, **kwargs):
        batches.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    tiny_model.forward = counting
    rows = [prompts[0]] * 16 + [prompts[1]] * 16 + [prompts[2]]
    gens = eng.generate(rows, SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(-1,)))
    assert batches == [3, 33, 33, 33]  # one prefill row per distinct prompt, then every row decodes
    for prompt, g in zip(rows, gens):
        assert g.logprobs == pytest.approx(_recompute(tiny_model, prompt, g.token_ids, 1.0), abs=1e-4)
    assert len({tuple(g.token_ids) for g in gens[:16]}) > 1  # the copies draw independently
    batches.clear()
    greedy = eng.generate(rows[15:18], SamplingParams(max_new_tokens=4, temperature=0.0))
    alone = [eng.generate([p], SamplingParams(max_new_tokens=4, temperature=0.0))[0] for p in rows[15:18]]
    assert batches[0] == 2 and [g.token_ids for g in greedy] == [g.token_ids for g in alone]


def test_sampling_draws_each_row_from_its_distribution_and_never_a_zero_mass_token():
    from astraflow.engines.hf import sample_rows

    rows = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.2, 0.0, 0.2]])  # the second: a nucleus, unnormalised
    keys = torch.randint(0, 1 << 62, (200_000,), generator=torch.Generator().manual_seed(0))
    steps = torch.randint(0, 4096, (200_000,), generator=torch.Generator().manual_seed(1))
    draws = sample_rows(rows.repeat(100_000, 1), keys, steps).view(100_000, 2)
    for r in range(2):
        freq = torch.bincount(draws[:, r], minlength=4).double() / 100_000
        assert torch.allclose(freq, (rows[r] / rows[r].sum()).double(), atol=0.006), freq
    assert not (draws[:, 0] == 1).any() and not (draws[:, 1] % 2 == 0).any()
    again = sample_rows(rows.repeat(100_000, 1), keys, steps).view(100_000, 2)
    assert torch.equal(draws, again)  # the same keys and token indices: the same draws


def test_greedy_is_argmax_and_stops_at_eos(tiny_model, tiny_tokenizer, prompts):
    model = tiny_model
    eng = build_engine({}, model)
    tok = tiny_tokenizer
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0))
    for prompt, g in zip(prompts, gens):
        ids = list(prompt)
        for t in g.token_ids:
            with torch.no_grad():
                assert int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()) == t
            ids.append(t)
        assert g.finish_reason == ("stop" if g.token_ids[-1] == tok.eos_token_id else "length")
        assert tok.eos_token_id not in g.token_ids[:-1]


def test_version_tags_change_after_a_full_state_update(tiny_model, tiny_checkpoint, prompts):
    eng = build_engine({}, tiny_model, version=0)
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(-1,))
    assert all(v == 0 for g in eng.generate(prompts, params) for v in g.versions)
    new = load_model(tiny_checkpoint)  # same shapes, perturbed and loaded as version 7
    sd = {k: v + 0.01 for k, v in new.state_dict().items()}
    eng.update_weights(FullState(sd, 7))
    assert eng.weight_version == 7
    assert torch.equal(eng.state_dict()["model.norm.weight"], sd["model.norm.weight"])
    assert all(v == 7 for g in eng.generate(prompts, params) for v in g.versions)


def test_weights_swapped_mid_generation_tag_later_tokens(tiny_model, prompts):
    model = tiny_model
    eng = build_engine({}, model, version=1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    calls = {"n": 0}
    original = model.forward

    def forward(*a, **kw):  # after the 2nd decoding step, another thread swaps the weights
        calls["n"] += 1
        if calls["n"] == 3:
            t = threading.Thread(target=eng.update_weights, args=(FullState(sd, 2),))
            t.start()
            # the swap must wait for this step (the engine holds its lock during a forward)
            t.join(timeout=0.2)
            assert t.is_alive()
            calls["thread"] = t
        return original(*a, **kw)

    model.forward = forward
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=5, stop_token_ids=(-1,)))
    calls["thread"].join()
    for g in gens:
        assert g.versions == [1, 1, 1, 2, 2]


def test_agenerate_merges_concurrent_requests(tiny_model, prompts):
    from astraflow.engines import HFEngineConfig

    eng = build_engine(HFEngineConfig(batching="request"), tiny_model)
    seen = []
    original = eng.generate

    def spy(prompts, params):
        seen.append(len(prompts))
        return original(prompts, params)

    eng.generate = spy

    async def main():
        p = prompts
        return await asyncio.gather(*(eng.agenerate([p[i % 3]] * 4, SamplingParams(max_new_tokens=2))
                                      for i in range(5)))

    out = asyncio.run(main())
    assert [len(o) for o in out] == [4] * 5
    assert sum(seen) == 20 and len(seen) < 5


def test_engine_section_without_type_is_the_hf_engine(tiny_model):
    from astraflow.engines import HFEngineConfig, parse_engine
    from astraflow.engines.hf import HFEngine

    assert parse_engine({"seed": 3}) == HFEngineConfig(seed=3)
    eng = build_engine(HFEngineConfig(max_batch_size=2), tiny_model, version=4)
    assert isinstance(eng, HFEngine) and eng.weight_version == 4 and eng._batcher.max_batch_size == 2


def test_merged_batches_respect_max_batch_size_and_a_new_event_loop(tiny_model, prompts):
    from astraflow.engines import HFEngineConfig

    eng = build_engine(HFEngineConfig(max_batch_size=5, batching="request"), tiny_model)
    seen = []
    original = eng.generate

    def spy(prompts, params):
        seen.append(len(prompts))
        return original(prompts, params)

    eng.generate = spy
    p = prompts

    async def main(sizes):
        outs = await asyncio.gather(*(eng.agenerate([p[0]] * n, SamplingParams(max_new_tokens=1)) for n in sizes))
        return [len(o) for o in outs]

    assert asyncio.run(main([2, 2, 2, 7])) == [2, 2, 2, 7]  # a request is never split: 7 runs alone
    assert sorted(seen) == [2, 4, 7]
    seen.clear()
    assert asyncio.run(main([1, 1])) == [1, 1]  # a second event loop gets its own queue and worker
    assert seen == [2]


def test_a_failed_merged_batch_fails_each_request_in_it():
    from astraflow.engines.batching import RequestBatcher

    class Broken:
        def generate(self, prompts, params):
            raise RuntimeError("out of memory")

    batcher = RequestBatcher(Broken(), max_batch_size=8)

    async def main():
        return await asyncio.gather(*(batcher.submit([[1]], SamplingParams()) for _ in range(3)),
                                    return_exceptions=True)

    assert [str(e) for e in asyncio.run(main())] == ["out of memory"] * 3


def test_an_engine_without_batching_gets_a_threaded_agenerate():
    from astraflow.engines import Engine, Generation

    class Echo(Engine):  # no __init__ of its own state, like a test double or a minimal connector
        def generate(self, prompts, params):
            return [Generation(list(p), [0.0] * len(p), [0] * len(p), "stop") for p in prompts]

        def update_weights(self, update):
            pass

        @property
        def weight_version(self):
            return 0

        def state_dict(self):
            return {}

    (g,) = asyncio.run(Echo().agenerate([[4, 5]], SamplingParams()))
    assert g.token_ids == [4, 5]


def test_an_hf_engine_option_typo_is_refused_at_recipe_load(tmp_path, tiny_checkpoint):
    import yaml

    from astraflow.config import ConfigError
    from astraflow.recipe import Recipe

    data = yaml.safe_load(Path("examples/recipes/math.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_checkpoint)
    data["pools"][0]["engine"] = {"type": "hf", "devcie": "cpu"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"pools\.0\.engine: engine 'hf': devcie: Extra inputs are not permitted"):
        Recipe.load(tmp_path / "r.yaml")


def test_validating_an_engine_section_imports_no_engine_runtime():
    code = ("import sys; from astraflow.engines import parse_engine; parse_engine({'type': 'simulated'}); "
            "parse_engine({'device': 'cpu'}); "
            "print(sorted(m for m in ('torch', 'astraflow.engines.hf', 'astraflow.engines.simulated') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_connector_registers_its_own_engine_type_and_recipes_validate_it():
    from typing import Literal

    from pydantic import BaseModel, ValidationError

    from astraflow.engines import BaseEngineConfig, Engine, EngineConfig, Generation, register_engine

    class EchoEngineConfig(BaseEngineConfig):  # what connectors/<name> would declare
        type: Literal["test_echo"] = "test_echo"
        repeat: int = 1

    class Echo(Engine):
        def __init__(self, config, version):
            self.config, self._version = config, version

        def generate(self, prompts, params):
            return [Generation(p * self.config.repeat, [0.0] * len(p) * self.config.repeat,
                               [self._version] * len(p) * self.config.repeat, "stop") for p in prompts]

        def update_weights(self, update):
            self._version = update.version

        @property
        def weight_version(self):
            return self._version

        def state_dict(self):
            return {}

    @register_engine("test_echo", EchoEngineConfig)
    def build(config, model, *, version):
        return Echo(config, version)

    class Pool(BaseModel):  # the shape of recipe.PoolSpec's engine field
        engine: EngineConfig

    pool = Pool.model_validate({"engine": {"type": "test_echo", "repeat": 2, "seed": 5}})
    assert pool.engine == EchoEngineConfig(repeat=2, seed=5)
    assert Pool.model_validate(pool.model_dump()).engine == pool.engine  # serialised with its options
    (g,) = build_engine(pool.engine, None, version=3).generate([[7]], SamplingParams())
    assert g.token_ids == [7, 7] and g.versions == [3, 3]
    with pytest.raises(ValidationError, match="engine 'test_echo': repet: Extra inputs are not permitted"):
        Pool.model_validate({"engine": {"type": "test_echo", "repet": 2}})
    with pytest.raises(ValueError, match="must default to 'other'"):
        register_engine("other", EchoEngineConfig)


def test_a_waiting_swap_goes_before_the_next_step():
    """The gate's promise, without a model: a swap that waits during a step runs before any
    later step, however eagerly the stepping thread comes back (a plain lock lets it starve)."""
    from astraflow.engines.swap_gate import SwapGate

    gate, order = SwapGate(), []

    def swap():
        with gate.swap():
            order.append("swap")

    with gate.step():
        order.append("step 1")
        t = threading.Thread(target=swap)
        t.start()
        while gate._waiting_swaps == 0:  # until the swap thread waits on the gate
            time.sleep(0.001)
    for i in range(2, 6):  # steps come back at once, as a decoding loop does
        with gate.step():
            order.append(f"step {i}")
    t.join()
    assert order[:3] == ["step 1", "swap", "step 2"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_a_cuda_engine_decodes_as_the_cpu_engine(tiny_checkpoint, prompts):
    """Greedy tokens and log-probs as on the CPU; sampled tokens' log-probs match a CPU recomputation."""
    cpu = build_engine({"seed": 3}, load_model(tiny_checkpoint))
    gpu = build_engine({"seed": 3, "device": "cuda"}, load_model(tiny_checkpoint))
    assert all(p.is_cuda for p in gpu.model.parameters())
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(-1,))
    for a, b in zip(cpu.generate(prompts, greedy), gpu.generate(prompts, greedy), strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    reference = load_model(tiny_checkpoint)
    sampled = SamplingParams(max_new_tokens=6, temperature=0.7, stop_token_ids=(-1,))
    for prompt, g in zip(prompts, gpu.generate(prompts, sampled), strict=True):
        assert g.logprobs == pytest.approx(_recompute(reference, prompt, g.token_ids, 0.7), abs=1e-4)


def _nudged(state: dict, every: int) -> dict:
    """A copy with every ``every``-th entry of each storage one ulp up (tied names keep one tensor)."""
    out, by_storage = {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in by_storage:
            bits = t.detach().cpu().clone().view(torch.int16).reshape(-1)
            bits[::every] += 1
            by_storage[key] = bits.view(t.dtype).reshape(t.shape)
        out[name] = by_storage[key]
    return out


@needs_cuda
def test_a_delta_chain_patches_a_bf16_cuda_engine_bit_exact(tiny_checkpoint, prompts):
    """A node's refresh on a GPU: two deltas folded into one patch, written into the engine's CUDA
    tensors between decoding steps, bit-exact to the trainer's weights, verified by checksum."""
    from astraflow.delta import encode
    from astraflow.delta.patch import one_part, prepare_patch

    engine = build_engine({"device": "cuda"}, load_model(tiny_checkpoint).to(torch.bfloat16), version=0)
    v0 = {k: v.cpu().clone() for k, v in engine.state_dict().items()}
    v1 = _nudged(v0, 37)
    v2 = _nudged(v1, 53)
    deltas = [one_part(1, encode(v0, v1, base_version=0, target_version=1)),
              one_part(2, encode(v1, v2, base_version=1, target_version=2))]
    live = engine.state_dict()
    patch = prepare_patch(live, deltas, base_version=0)
    assert patch.changed and all(c.new_bits is None for c in patch.changes)  # XOR on the device
    engine.update_weights(InPlacePatch(patch.write, patch.version))
    assert engine.weight_version == 2 and patch.verify(live) == []
    for name, t in engine.state_dict().items():
        assert t.is_cuda and torch.equal(t.cpu().view(torch.int16), v2[name].view(torch.int16)), name
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=3, stop_token_ids=(-1,)))
    assert all(v == 2 for g in gens for v in g.versions)
