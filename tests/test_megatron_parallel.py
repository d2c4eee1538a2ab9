"""connectors/megatron across ranks (CPU, gloo): the sharded HF <-> Megatron conversion is exact, and a
``GPTModel`` split with tensor parallelism (TP = 2), pipeline parallelism (PP = 2) or data parallelism
(DP = 2) computes the HF model's log-probs and takes the step a single rank takes.

Each multi-rank case starts a real rank group: worker processes with ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` set as torch.distributed.run sets them, joined by the trainer's own
``RankGroup.start`` (gloo), then Megatron's parallel state. The reference is the one-rank Megatron
backend in this process, whose step equals the built-in backend's (test_megatron_connector).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megatron_helpers import (
    _check_group,
    _llama,
    _qwen2,
    _run_group,
    unshard,
)

from connectors.megatron.convert import DecoderShape, hf_to_megatron
from connectors.megatron.shard import Layout, placement, shard

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="needs megatron-core (`pip install 'astraflow[megatron]'`)")


# -- the conversion, sharded (no process group) ---------------------------------------------------------

@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("tied", [True, False])
def test_shard_then_unshard_is_bit_exact_with_a_padded_vocabulary(tp, pp, tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=301, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, intermediate_size=96, tie_word_embeddings=tied))
    shape = DecoderShape.from_hf_config(model.config)
    whole = hf_to_megatron(model.state_dict(), shape)
    layout = Layout(tp=tp, pp=pp)
    pieces = [[shard(whole, shape, layout, 301, tp_rank=r, stage=s) for r in range(tp)] for s in range(pp)]
    assert pieces[0][0]["embedding.word_embeddings.weight"].shape[0] == layout.padded_vocab(301) // tp
    if tied and pp > 1:  # the last stage's copy of the embedding, as Megatron keeps it
        assert "output_layer.weight" in pieces[-1][0] and "output_layer.weight" not in pieces[0][0]
    back = unshard(pieces, shape, layout, 301)
    assert back.keys() == whole.keys()
    assert all(torch.equal(back[k], whole[k]) for k in whole)


def test_gated_fc1_and_row_parallel_pieces_follow_megatrons_layout():
    """Rank r's fc1 is [gate_r; up_r] (the activation splits its rows in two); fc2 keeps columns r;
    QKV keeps whole query groups; a layer lands on its stage under a stage-local index."""
    model = _qwen2()
    shape = DecoderShape.from_hf_config(model.config)
    hf = model.state_dict()
    whole = hf_to_megatron(hf, shape)
    layout = Layout(tp=2, pp=2)
    assert placement("decoder.layers.1.mlp.linear_fc2.weight", shape, layout) == [
        (1, "decoder.layers.0.mlp.linear_fc2.weight")]
    piece = shard(whole, shape, layout, 300, tp_rank=1, stage=1)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(piece["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[64:], up[64:]]))
    assert torch.equal(piece["decoder.layers.0.mlp.linear_fc2.weight"],
                       hf["model.layers.1.mlp.down_proj.weight"][:, 64:])
    qkv = whole["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(piece["decoder.layers.0.self_attention.linear_qkv.weight"], qkv[qkv.shape[0] // 2:])


def test_a_layout_that_does_not_divide_the_model_is_refused():
    shape = DecoderShape.from_hf_config(_llama().config)  # 4 heads, 1 key-value group, 2 layers
    with pytest.raises(ValueError, match="tensor_parallel=2 must divide"):
        Layout(tp=2).check(shape)
    with pytest.raises(ValueError, match="pipeline_parallel=4 must divide the layers"):
        Layout(pp=4).check(shape)


@needs_megatron
def test_pipeline_parallel_with_tied_embeddings_on_cpu_is_refused_by_name():
    from connectors.megatron.backend import MegatronBackend

    with pytest.raises(ValueError, match="tied embeddings needs Megatron's DDP for pipeline_parallel > 1"):
        MegatronBackend(_qwen2(), {"type": "megatron", "pipeline_parallel": 2})


# -- a real rank group ----------------------------------------------------------------------------------

@needs_megatron
@pytest.mark.parametrize("make", ["qwen2", "llama"])
def test_tensor_parallel_2_computes_hf_logits_and_steps_as_one_rank(tmp_path, make):
    reports = _run_group(tmp_path, 2, make, {"tensor_parallel": 2})
    assert sorted(r["tp_rank"] for r in reports) == [0, 1] and {r["dp"] for r in reports} == {1}
    _check_group(tmp_path, reports, make, 2)


@needs_megatron
def test_tensor_parallel_2_steps_a_kl_and_entropy_objective_as_one_rank(tmp_path):
    """The entropy over a vocabulary split in two (with its gradient: an entropy bonus) and the KL to a
    reference split like the policy, against the one-rank step."""
    objective = {"entropy_coef": 0.05, "aggregation": "seq_mean", "kl": {"coef": 0.3, "estimator": "k3"}}
    reports = _run_group(tmp_path, 2, "qwen2", {"tensor_parallel": 2, "objective": objective})
    assert all(r["metrics"]["kl_ref"] > 0 for r in reports)
    _check_group(tmp_path, reports, "qwen2", 2, objective)


@needs_megatron
def test_pipeline_parallel_2_computes_hf_logprobs_and_steps_as_one_rank(tmp_path):
    reports = _run_group(tmp_path, 2, "llama", {"pipeline_parallel": 2})  # untied: see the refusal above
    assert sorted(r["pp_rank"] for r in reports) == [0, 1]
    assert len(list(tmp_path.glob("logp-*.safetensors"))) == 1  # only the last stage
    _check_group(tmp_path, reports, "llama", 2)


@needs_megatron
def test_data_parallel_2_splits_the_batch_and_steps_as_one_rank(tmp_path):
    reports = _run_group(tmp_path, 2, "qwen2", {})
    assert sorted(r["dp_rank"] for r in reports) == [0, 1] and {r["dp"] for r in reports} == {2}
    _check_group(tmp_path, reports, "qwen2", 2)
