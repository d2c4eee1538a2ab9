"""Test helpers of the Megatron connector: the tiny HF models its tests convert (``_qwen2``, ``_llama``,
``_llama_gqa``), a batch of trajectories for them, a rank group run as processes and checked against the
one-rank reference (``_run_group``, ``_check_group``), and a sharded state put back together (``unshard``,
the inverse of :func:`connectors.megatron.shard.shard`) to check that sharding loses nothing."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from update_agreement import update_disagreement

from connectors.megatron.convert import DecoderShape
from connectors.megatron.shard import VOCAB_KEYS, Layout, tp_join, tp_split, whole_name


def unshard(stages: list[list[Mapping[str, torch.Tensor]]], shape: DecoderShape, layout: Layout,
            vocab: int) -> dict[str, torch.Tensor]:
    """The whole-model state dict from ``stages[s][r]``, the state of tensor-parallel rank ``r`` on
    stage ``s`` (the inverse of :func:`shard`; the last stage's tied copy is left out)."""
    out: dict[str, torch.Tensor] = {}
    for s, ranks in enumerate(stages):
        for local in ranks[0]:
            key = whole_name(local, s, shape, layout)
            if key is None or local.endswith("_extra_state"):
                continue
            whole = tp_join([r[local] for r in ranks], tp_split(local))
            out[key] = whole[:vocab] if key in VOCAB_KEYS else whole
    return out


def _qwen2(tied: bool = True):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=tied)).eval()


def _llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=96, max_position_embeddings=64, tie_word_embeddings=tied)).eval()


def _batch(model, vocab: int = 300):
    """2 groups x 4 samples with varied rewards; behaviour log-probs from ``model``."""
    from astraflow.records import Trajectory

    gen = torch.Generator().manual_seed(3)
    out = []
    for g in range(2):
        prompt = torch.randint(1, vocab, (5 + g,), generator=gen).tolist()
        for i in range(4):
            resp = torch.randint(1, vocab, (2 + i,), generator=gen).tolist()
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([prompt + resp])).logits[0], -1)
            out.append(Trajectory(
                episode_id=f"t{g}/p/{i}", task_id=f"t{g}", group_id=f"t{g}/p", sample_index=i, policy="p",
                prompt_ids=prompt, response_ids=resp,
                logprobs=[float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(resp)],
                versions=[0] * len(resp), loss_mask=[1] * len(resp), reward=float(i % 2 == 0), rewards={},
                turn_bounds=[0, len(resp)], node_id="n", created_at=0.0, gen_seconds=0.0, task_type="t"))
    return out


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


def _worker(rank: int, world: int, port: int, make: str, options: dict, out: str, redirect_cuda: bool) -> None:
    """One rank: join the group as torch.distributed.run's worker would, build the backend, report.
    ``redirect_cuda``: run Megatron's own DDP / distributed optimizer / schedules with their CUDA
    allocations sent to the CPU (test_megatron_cuda_path_on_cpu)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if redirect_cuda:
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
    logp = response_logprobs(backend, trajs)
    if logp is not None:
        save_file({"logp": logp.contiguous()}, f"{out}/logp-{rank}.safetensors")
    if backend.layout.pp == 1:
        ids = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            save_file({"logits": backend.logits(ids, torch.ones_like(ids)).contiguous()},
                      f"{out}/logits-{rank}.safetensors")
    if backend.wants_reference:
        backend.set_reference(_perturbed(model.state_dict()) if rank == 0 else {})
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


def response_logprobs(backend, trajectories) -> torch.Tensor | None:
    """log pi of every response token ``[B, R]`` under the backend's current weights, on the last pipeline
    stage (None elsewhere): the backend's own forward-only pass (collective over a pipeline)."""
    from connectors.megatron.batch import micro_batch

    kept = backend._forward_only(micro_batch(trajectories, [0.0] * len(trajectories), 1.0, backend.device))
    return None if kept is None else kept["logp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(tmp_path: Path, world: int, make: str, options: dict, *, redirect_cuda: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port(), make, options, str(tmp_path), redirect_cuda), nprocs=world,
             join=True)
    return [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(world)]


def _perturbed(state: dict) -> dict:
    """A reference policy other than the initial weights (seeded), for a KL objective."""
    gen = torch.Generator().manual_seed(6)
    return {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def _reference(make: str, objective: dict | None = None):
    """One rank, tp = pp = 1, in this process: the HF model, the batch, the weights before and after a step."""
    import copy

    from connectors.megatron.backend import MegatronBackend

    model = MODELS[make]()
    trajs = _batch(model)
    backend = MegatronBackend(copy.deepcopy(model), {"type": "megatron", "lr": LR, "objective": objective or {}})
    if backend.wants_reference:
        backend.set_reference(_perturbed(model.state_dict()))
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


def _check_group(tmp_path: Path, reports: list[dict], make: str, world: int, objective: dict | None = None) -> None:
    from safetensors.torch import load_file

    model, trajs, ref_before, ref_metrics, ref_after = _reference(make, objective)
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
        for key in ("loss", "grad_norm", "clip_frac", "behav_kl", "trained_trajectories", "entropy", "kl_ref"):
            assert (key in r["metrics"]) == (key in ref_metrics), (r["rank"], key)
            if key in ref_metrics:
                assert r["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (r["rank"], key)
    assert reports[0]["reload_exact"] is True
    # A model split over tp or pp leaves each rank a part of the parameters; dp replicas hold them all.
    whole = sum(t.numel() for k, t in ref_before.items() if not (k == "lm_head.weight" and model.config.tie_word_embeddings))
    split = reports[0]["dp"] < world
    assert all((r["params"] < whole) if split else (r["params"] == whole) for r in reports), [r["params"] for r in reports]


# -- Megatron's CUDA path on CPU ranks (tests/test_megatron_cuda_path_on_cpu.py) --------------------------
class _CudaDeviceToCpu(torch.overrides.TorchFunctionMode):
    """``device="cuda"`` (or an index, as ``torch.cuda.current_device()`` returns) becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if isinstance(device, int) or (device is not None and torch.device(device).type == "cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


class _NoStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass


@contextlib.contextmanager
def redirect_cuda_to_cpu() -> Iterator[None]:
    """For a worker process only (it patches torch.cuda for good)."""
    cpu_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = cpu_type(self, *args, **kwargs)
        if args or kwargs or not name.startswith("torch.") or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = _NoStream
    torch.cuda.default_stream = torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.Tensor.type = cuda_type
    with _CudaDeviceToCpu():
        yield
