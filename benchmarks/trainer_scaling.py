"""The torch trainer backend as 1, 2 and 4 ranks (FSDP2 on gloo, CPU): seconds per step and the
parameter + optimizer memory each rank holds, with the one-process backend (what ``trainer.ranks: 1``
runs) as the baseline in the same run.

    nice -n 10 python benchmarks/trainer_scaling.py [--ranks 1 2 4] [--hidden 256] [--layers 4]

Every configuration runs in fresh processes started by torch.distributed's elastic agent (the
launcher ``astraflow run`` uses for ``trainer.ranks``), on a Qwen2-architecture model built from the
given shape (seeded), a GRPO batch of ``--batch`` sequences of 32 prompt + ``--tokens`` response
tokens. Per configuration: the median step time over ``--reps`` steps after one warm-up step; the
bytes of the parameters and of the AdamW state resident on each rank after a step (FSDP2's shards:
near 1/N of the whole, plus padding; the layer being computed is gathered whole for a moment and is
not counted); the largest resident set size of a rank (the process, torch included); and the time to
gather the full weights on rank 0 and cast them to bf16 (what each step publishes). The threads of a
machine's cores are split among the ranks. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid


def _batch(vocab: int, n: int, response: int) -> list:
    import torch

    from astraflow.records import Trajectory

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(1, vocab, (32,), generator=g).tolist()
        resp = torch.randint(1, vocab, (response,), generator=g).tolist()
        out.append(Trajectory(
            episode_id=f"b/{i}", task_id=f"t{i // 4}", group_id=f"t{i // 4}/p", sample_index=i % 4, policy="p",
            prompt_ids=prompt, response_ids=resp, logprobs=[-5.0] * response, versions=[0] * response,
            loss_mask=[1] * response, reward=float(i % 2)))
    return out


def _model(shape: dict):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=max(1, shape["heads"] // 4),
        intermediate_size=shape["intermediate"], max_position_embeddings=512, tie_word_embeddings=True))


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _measure(shape: dict, batch: int, tokens: int, reps: int, threads: int, plain: bool) -> dict:
    """One rank's figures (runs in a worker process)."""
    import resource

    import torch

    from astraflow.trainer.distributed import SINGLE, current_group
    from astraflow.trainer.torch_backend import TorchBackend

    torch.set_num_threads(threads)
    group = SINGLE if plain else current_group()
    group.start("cpu")
    backend = TorchBackend(_model(shape), {"lr": 1e-5, "skip_zero_advantage": False}, group=group)
    trajs = _batch(shape["vocab"], batch, tokens)
    backend.step(trajs)  # warm-up; creates the AdamW state
    times = []
    for _ in range(reps):
        group.barrier()
        t0 = time.perf_counter()
        backend.step(trajs)
        times.append(time.perf_counter() - t0)
    params = _local_bytes(backend.model.parameters())
    optimizer = _local_bytes(v for s in backend.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    group.barrier()
    t0 = time.perf_counter()
    full = backend.state_dict(torch.bfloat16)
    gather_s = time.perf_counter() - t0
    out = {"rank": group.rank, "step_s": statistics.median(times), "param_bytes": params, "optimizer_bytes": optimizer,
           "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "publish_gather_s": gather_s, "published_tensors": len(full)}
    group.close()
    return out


def _launch(ranks: int, *args) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=uuid.uuid4().hex[:8],
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
                          monitor_interval=0.1)
    return elastic_launch(config, _measure)(*args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes to run (FSDP2)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch")
    ap.add_argument("--tokens", type=int, default=64, help="response tokens per sequence")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args(argv)
    shape = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "intermediate", "vocab")}
    n_params = sum(p.numel() for p in _model(shape).parameters())
    print(f"model: {n_params / 1e6:.1f} M parameters (fp32 masters, AdamW: ~{16 * n_params / 2**20:.0f} MiB "
          f"of parameters + optimizer state + gradients on one rank); {args.cores} cores", flush=True)

    rows = []
    for ranks, plain in [(1, True), *((r, False) for r in args.ranks)]:
        threads = max(1, args.cores // ranks)
        per_rank = _launch(ranks, shape, args.batch, args.tokens, args.reps, threads, plain)
        figures = [per_rank[r] for r in sorted(per_rank)]
        row = {"ranks": ranks, "layout": "plain" if plain else "fsdp2", "threads_per_rank": threads,
               "step_s": max(f["step_s"] for f in figures),
               "param_bytes_per_rank": max(f["param_bytes"] for f in figures),
               "optimizer_bytes_per_rank": max(f["optimizer_bytes"] for f in figures),
               "max_rss_mib_per_rank": round(max(f["max_rss_bytes"] for f in figures) / 2**20, 1),
               "publish_gather_s": figures[0]["publish_gather_s"]}
        rows.append(row)
        print(f"{row['layout']:>5} x{ranks}: {row['step_s']:.3f} s/step, params + optimizer "
              f"{(row['param_bytes_per_rank'] + row['optimizer_bytes_per_rank']) / 2**20:.1f} MiB per rank, "
              f"max RSS {row['max_rss_mib_per_rank']} MiB, gather + bf16 cast on rank 0 "
              f"{row['publish_gather_s']:.3f} s", flush=True)
    base = rows[0]
    base_mem = base["param_bytes_per_rank"] + base["optimizer_bytes_per_rank"]
    for row in rows:
        mem = row["param_bytes_per_rank"] + row["optimizer_bytes_per_rank"]
        row["memory_vs_plain"] = round(mem / base_mem, 4)
        row["step_vs_plain"] = round(row["step_s"] / base["step_s"], 3)
    print(json.dumps({"benchmark": "trainer_scaling", "params": n_params, "shape": shape, "batch": args.batch,
                      "tokens": args.tokens, "cores": args.cores, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
