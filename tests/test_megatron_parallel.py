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
import json
import os
import socket
from pathlib import Path

import pytest
import torch
from megatron_helpers import unshard
from test_megatron_connector import _batch, _llama, _qwen2
from update_agreement import update_disagreement

from connectors.megatron.convert import DecoderShape, hf_to_megatron
from connectors.megatron.shard import Layout, placement, shard

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="needs megatron-core (`pip install 'astraflow[megatron]'`)")


def _llama_gqa():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=64, tie_word_embeddings=False)).eval()


MODELS = {"qwen2": _qwen2, "llama": _llama_gqa}
"""qwen2: tied, QKV bias; llama: untied, no bias. Both 4 heads / 2 key-value groups: Megatron splits
whole query groups, so tp = 2 needs 2 (an MQA model is refused, below)."""
LR = 1e-2


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

def _worker(rank: int, world: int, port: int, make: str, options: dict, out: str, redirect_cuda: bool) -> None:
    """One rank: join the group as torch.distributed.run's worker would, build the backend, report.
    ``redirect_cuda``: run Megatron's own DDP / distributed optimizer / schedules with their CUDA
    allocations sent to the CPU (test_megatron_cuda_path_on_cpu)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if redirect_cuda:
        from test_megatron_cuda_path_on_cpu import redirect_cuda_to_cpu

        with redirect_cuda_to_cpu():
            _rank(rank, make, options, out, distributed_optimizer=True)
    else:
        _rank(rank, make, options, out, distributed_optimizer=False)


def _rank(rank: int, make: str, options: dict, out: str, *, distributed_optimizer: bool) -> None:
    from safetensors.torch import save_file

    from astraflow.trainer.distributed import current_group
    from connectors.megatron.backend import MegatronBackend
    from connectors.megatron.config import MegatronBackendConfig

    group = current_group()
    group.start("cpu", timeout_s=120)
    model = MODELS[make]()
    trajs = _batch(model)
    config = MegatronBackendConfig.model_validate({"type": "megatron", "lr": LR, **options})
    # model_copy does not validate: the option refuses a CPU device, which the redirection stands in for.
    backend = MegatronBackend(model, config.model_copy(update={"distributed_optimizer": distributed_optimizer}))
    assert type(backend.training).__name__ == ("MegatronTraining" if distributed_optimizer else "TorchTraining")
    ranks = backend.ranks
    report: dict = {"rank": rank, "tp_rank": ranks.tp_rank, "pp_rank": ranks.pp_rank, "dp_rank": ranks.dp_rank,
                    "dp": ranks.dp, "params": sum(p.numel() for p in backend.model.parameters())}
    logp = backend.response_logprobs(trajs)
    if logp is not None:
        save_file({"logp": logp.contiguous()}, f"{out}/logp-{rank}.safetensors")
    if backend.layout.pp == 1:
        ids = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            save_file({"logits": backend.logits(ids, torch.ones_like(ids)).contiguous()},
                      f"{out}/logits-{rank}.safetensors")
    before = backend.state_dict()
    report["metrics"] = backend.step(trajs)
    after = backend.state_dict()
    report["state_keys"] = list(after)
    if after:
        save_file(before, f"{out}/before.safetensors")
        save_file(after, f"{out}/after.safetensors")
    # load_state: rank 0's weights (here: those before the step) reach every rank's piece.
    backend.load_state(before if rank == 0 else {}, None)
    reloaded = backend.state_dict()
    report["reload_exact"] = all(torch.equal(reloaded[k], before[k]) for k in before) if reloaded else None
    Path(out, f"report-{rank}.json").write_text(json.dumps(report))
    group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(tmp_path: Path, world: int, make: str, options: dict, *, redirect_cuda: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port(), make, options, str(tmp_path), redirect_cuda), nprocs=world,
             join=True)
    return [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(world)]


def _reference(make: str):
    """One rank, tp = pp = 1, in this process: the HF model, the batch, the weights before and after a step."""
    import copy

    from connectors.megatron.backend import MegatronBackend

    model = MODELS[make]()
    trajs = _batch(model)
    backend = MegatronBackend(copy.deepcopy(model), {"type": "megatron", "lr": LR})
    before = backend.state_dict()
    metrics = backend.step(trajs)
    return model, trajs, before, metrics, backend.state_dict()


def _hf_logprobs(model, trajs) -> torch.Tensor:
    """log pi(response token) under the HF model, laid out as the backend's ``[B, R]``."""
    width = max(len(t.response_ids) for t in trajs)
    out = torch.zeros(len(trajs), width)
    for i, t in enumerate(trajs):
        ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        p = len(t.prompt_ids)
        for j, tok in enumerate(t.response_ids):
            out[i, j] = lp[p - 1 + j, tok]
    return out


def _check_group(tmp_path: Path, reports: list[dict], make: str, world: int) -> None:
    from safetensors.torch import load_file

    model, trajs, ref_before, ref_metrics, ref_after = _reference(make)
    # Every rank of a replica computes the HF model's log-probs (the last stage holds them).
    hf_logp = _hf_logprobs(model, trajs)
    mask = torch.zeros_like(hf_logp)
    for i, t in enumerate(trajs):
        mask[i, : len(t.response_ids)] = 1
    files = sorted(tmp_path.glob("logp-*.safetensors"))
    assert files
    for f in files:
        assert ((load_file(f)["logp"] - hf_logp).abs() * mask).max().item() < 1e-5, f.name
    for f in sorted(tmp_path.glob("logits-*.safetensors")):  # the whole logits, gathered over tp
        ids = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert (load_file(f)["logits"] - model(input_ids=ids).logits).abs().max().item() < 1e-5, f.name
    # Rank 0 alone holds the gathered weights in HF names, bit-exact to the one-rank backend's start.
    assert [r["state_keys"] for r in reports] == [list(ref_before)] + [[]] * (world - 1)  # HF names, HF order
    before, after = load_file(tmp_path / "before.safetensors"), load_file(tmp_path / "after.safetensors")
    assert before.keys() == ref_before.keys() and all(torch.equal(before[k], ref_before[k]) for k in before)
    # The step agrees with one rank's: the update as a whole, and the loss and grad norm every rank reports.
    assert update_disagreement(ref_before, ref_after, after) < 1e-4
    for r in reports:
        for key in ("loss", "grad_norm", "clip_frac", "behav_kl", "trained_trajectories"):
            assert r["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (r["rank"], key)
    assert reports[0]["reload_exact"] is True
    # A model split over tp or pp leaves each rank a part of the parameters; dp replicas hold them all.
    whole = sum(t.numel() for k, t in ref_before.items() if not (k == "lm_head.weight" and model.config.tie_word_embeddings))
    split = reports[0]["dp"] < world
    assert all((r["params"] < whole) if split else (r["params"] == whole) for r in reports), [r["params"] for r in reports]


@needs_megatron
@pytest.mark.parametrize("make", ["qwen2", "llama"])
def test_tensor_parallel_2_computes_hf_logits_and_steps_as_one_rank(tmp_path, make):
    reports = _run_group(tmp_path, 2, make, {"tensor_parallel": 2})
    assert sorted(r["tp_rank"] for r in reports) == [0, 1] and {r["dp"] for r in reports} == {1}
    _check_group(tmp_path, reports, make, 2)


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
