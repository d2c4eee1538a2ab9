"""What the engine's pause costs at least: storing a sparse update into a model's tensors, in memory.

``WeightPatch.write`` (astraflow/delta/patch.py) is the only work done while an engine is paused: it
stores the new bits at the changed positions, tensor by tensor on two threads. This script times that
store, and its alternatives, on tensors with the shapes of Qwen2.5-1.5B (bf16, zeros; a random
``--changed`` share of each tensor's entries at sorted positions), without S3 or a broker:

* ``numpy_1_thread`` / ``numpy_2_threads``: ``bits[positions] = new_bits`` (what ``write`` does);
* ``torch_index_put``: ``index_put_`` on one Python thread (torch's own intra-op threads);
* ``numpy_int32_positions``: the same store with 32-bit positions (half the index bytes read);
* ``cache_resident_ns_per_entry`` against ``model_sized_ns_per_entry``: one store into a 1 M-entry array
  (it stays in the CPU caches) and into a 500 M-entry one, per entry, one thread;
* ``copy_GBps``: a plain tensor copy, the memory bandwidth the store competes for.

The gap between the cache-resident and model-sized cost per entry says whether the pause is bound by
the Python/numpy overhead per entry or by memory. Prints one JSON line last.

    python benchmarks/patch_scatter.py [--changed 0.01] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_refresh import SHAPES


def model_tensors(name: str) -> list[torch.Tensor]:
    """Zero bf16 tensors with the 2-D weight shapes of ``name`` (norms and biases are too small to count)."""
    hidden, inter, layers, heads, kv, hd, vocab = SHAPES[name]
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(heads * hd, hidden), (kv * hd, hidden), (kv * hd, hidden), (hidden, heads * hd),
                   (inter, hidden), (inter, hidden), (hidden, inter)]
    return [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]


def sparse_changes(tensors: list[torch.Tensor], changed: float, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    out = []
    for t in tensors:
        n = t.numel()
        k = max(1, int(n * changed))
        positions = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        out.append((t, positions, rng.integers(1, 30000, k).astype(np.int16)))
    return out


def store_numpy(change: tuple) -> None:
    t, positions, new_bits = change
    t.view(torch.int16).numpy().reshape(-1)[positions] = new_bits


def store_torch(change: tuple) -> None:
    t, positions, new_bits = change
    t.view(torch.int16).view(-1).index_put_((torch.from_numpy(positions),), torch.from_numpy(new_bits))


def timed(fn, changes: list[tuple], threads: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        if threads == 1:
            for c in changes:
                fn(c)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(fn, changes))
        best = min(best, time.perf_counter() - t0)
    return best


def ns_per_entry(entries: int, changed: float, reps: int) -> float:
    rng = np.random.default_rng(1)
    bits = np.zeros(entries, dtype=np.int16)
    k = int(entries * changed)
    positions = np.sort(rng.choice(entries, k, replace=False))
    new_bits = rng.integers(1, 30000, k).astype(np.int16)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        bits[positions] = new_bits
        best = min(best, time.perf_counter() - t0)
    return best / k * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--changed", type=float, default=0.01, help="share of entries changed (0.01)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the best counts")
    args = ap.parse_args(argv)

    tensors = model_tensors(args.model)
    changes = sparse_changes(tensors, args.changed)
    entries = sum(len(p) for _, p, _ in changes)
    int32 = [(t, p.astype(np.int32), v) for t, p, v in changes]
    torch.set_num_threads(2)
    result: dict = {
        "benchmark": "patch_scatter", "model": args.model, "changed": args.changed, "entries": entries,
        "model_gb": round(sum(t.numel() * 2 for t in tensors) / 1e9, 2),
        "numpy_1_thread_s": round(timed(store_numpy, changes, 1, args.reps), 3),
        "numpy_2_threads_s": round(timed(store_numpy, changes, 2, args.reps), 3),
        "numpy_int32_positions_2_threads_s": round(timed(store_numpy, int32, 2, args.reps), 3),
        "torch_index_put_s": round(timed(store_torch, changes, 1, args.reps), 3),
    }
    del tensors, changes, int32
    result["cache_resident_ns_per_entry"] = round(ns_per_entry(1_000_000, args.changed, args.reps), 2)
    result["model_sized_ns_per_entry"] = round(ns_per_entry(500_000_000, args.changed, args.reps), 2)
    src = torch.ones(400_000_000, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy faults the pages in
    t0 = time.perf_counter()
    dst.copy_(src)
    result["copy_GBps"] = round(src.numel() * 2 / (time.perf_counter() - t0) / 1e9, 1)
    result["memory_bound_ratio"] = round(result["model_sized_ns_per_entry"] / result["cache_resident_ns_per_entry"], 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
