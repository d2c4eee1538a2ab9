"""Delta codec vs AstraFlow's published format (u32 index + bf16 value) vs plain zstd, one core.

Workloads (both seeded, reproducible):

* synthetic — a 58M-parameter transformer-shaped state dict (6 layers, d 512, vocab 32000). Master weights are fp32 N(0, 0.02);
  the published weights are their bf16 casts (mixed precision, as an RL trainer publishes them).
  Adam state is warmed with ``--adam-warmup`` random-gradient steps (beta 0.9/0.999), then one
  Adam step at lr 1e-6 is taken; the delta is between the two bf16 casts. The warm-up length
  calibrates sparsity (8 steps -> ~98.5%); the measured sparsity is reported.
* real — a small causal transformer trained here (fp32 master weights, Adam) on a synthetic
  next-token task; deltas between the bf16 casts before and after one optimizer step, at the RL
  learning rate 1e-6 and at 1e-5.

For each: sparsity, bytes as % of the full bf16 size, bytes per changed parameter, encode and
decode GB/s of model bytes (bf16 size / seconds) with torch and numpy on ONE thread; decode is
timed in place (alternating the forward and the backward delta) and as a copy (``apply``). Each
timing is the best of ``--repeats`` runs; the median is printed too, as the machine is shared.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import zstandard

from astraflow.delta import apply, apply_inplace, encode, read_header

LR = 1e-6


def timed(fn, repeats: int) -> tuple[float, float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), out


def int_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).reshape(-1).numpy()


# -- workloads ---------------------------------------------------------------------------------
def synthetic_shapes(layers: int = 6, d: int = 512, ff: int = 2048, vocab: int = 32000) -> dict[str, tuple]:
    shapes = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "attn.qkv.weight": (3 * d, d), p + "attn.out.weight": (d, d),
                   p + "mlp.up.weight": (ff, d), p + "mlp.gate.weight": (ff, d), p + "mlp.down.weight": (d, ff),
                   p + "norm1.weight": (d,), p + "norm2.weight": (d,)}
    shapes["lm_head.weight"] = (vocab, d)
    return shapes


def synthetic_step(seed: int, warmup: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    old, new = {}, {}
    for name, shape in synthetic_shapes().items():
        w = torch.randn(shape, generator=g) * 0.02
        m, v = torch.zeros(shape), torch.zeros(shape)
        for _ in range(warmup + 1):
            grad = torch.randn(shape, generator=g)
            m.mul_(0.9).add_(grad, alpha=0.1)
            v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        t = warmup + 1
        update = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt_() + 1e-8)
        old[name] = w.to(torch.bfloat16)
        new[name] = (w - LR * update).to(torch.bfloat16)
    return old, new


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 2048, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        block = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.blocks(self.embed(x), mask=mask, is_causal=True))


def real_steps(seed: int, lrs: list[float], warmup: int = 20) -> list[tuple[float, dict, dict]]:
    """Train TinyLM (fp32 master, Adam) on next-token prediction of noisy arithmetic sequences;
    return (lr, bf16 before, bf16 after) for one step at each lr, from the same warmed state."""
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch() -> torch.Tensor:
        start = torch.randint(0, 2048, (16, 1))
        step = torch.randint(1, 8, (16, 1))
        return (start + step * torch.arange(65)) % 2048

    def step() -> None:
        x = batch()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    out = []
    for lr in lrs:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        for group in opt.param_groups:
            group["lr"] = lr
        before = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        step()
        out.append((lr, before, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}))
    return out


# -- codecs --------------------------------------------------------------------------------------
def astraflow_encode(old: dict, new: dict) -> list[tuple[str, bytes]]:
    """AstraFlow v0.1.2's format: header (nnz u64, element size, flags), u32 indices, raw new values."""
    out = []
    for name, t in new.items():
        a, b = int_bits(old[name]), int_bits(t)
        idx = np.flatnonzero(a != b)
        header = np.array([idx.size, 2, 0], dtype=np.uint64).tobytes()
        out.append((name, header + idx.astype(np.uint32).tobytes() + b[idx].tobytes()))
    return out


def astraflow_decode(base: dict, records: list[tuple[str, bytes]]) -> None:
    for name, rec in records:
        nnz = int(np.frombuffer(rec, np.uint64, 1)[0])
        idx = np.frombuffer(rec, np.uint32, nnz, 24)
        int_bits(base[name])[idx] = np.frombuffer(rec, np.int16, nnz, 24 + 4 * nnz)


def zstd_encode(new: dict, level: int) -> list[tuple[str, bytes]]:
    z = zstandard.ZstdCompressor(level=level)
    return [(name, z.compress(int_bits(t))) for name, t in new.items()]


def zstd_decode(records: list[tuple[str, bytes]]) -> None:
    z = zstandard.ZstdDecompressor()
    for _name, rec in records:
        np.frombuffer(z.decompress(rec), np.int16)


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(int_bits(a[k]), int_bits(b[k])) for k in a)


def measure(old: dict, new: dict, repeats: int) -> dict:
    numel = sum(t.numel() for t in new.values())
    full = 2 * numel
    changed = sum(int(np.count_nonzero(int_bits(old[k]) != int_bits(new[k]))) for k in new)
    gb = full / 1e9

    def row(nbytes: int, enc: tuple, dec: tuple, extra: dict | None = None) -> dict:
        r = {
            "bytes": nbytes,
            "pct_of_full": round(100 * nbytes / full, 4),
            "bytes_per_changed_param": round(nbytes / max(changed, 1), 4),
            "encode_gbps": round(gb / enc[0], 3),
            "encode_gbps_median": round(gb / enc[1], 3),
            "decode_gbps": round(gb / dec[0], 3),
            "decode_gbps_median": round(gb / dec[1], 3),
        }
        return r | (extra or {})

    enc = timed(lambda: encode(old, new, base_version=0, target_version=1), repeats)
    delta = enc[2]
    back = encode(new, old, base_version=1, target_version=0)
    work = {k: v.clone() for k, v in old.items()}
    fwd_times, bwd_times = [], []
    for _ in range(repeats):
        fwd_times.append(timed(lambda: apply_inplace(work, delta, base_version=0), 1)[0])
        bwd_times.append(timed(lambda: apply_inplace(work, back, base_version=1), 1)[0])
    inplace = (min(fwd_times), statistics.median(fwd_times))
    copy = timed(lambda: apply(old, delta, base_version=0), repeats)
    exact = same_bits(copy[2], new) and same_bits(apply_inplace(work, delta), new)
    ours = row(len(delta), enc, inplace, {
        "decode_copy_gbps": round(gb / copy[0], 3),
        "decode_copy_gbps_median": round(gb / copy[1], 3),
        "bit_exact": exact,
        "header_sparsity": round(read_header(delta).sparsity, 6),
    })

    a_enc = timed(lambda: astraflow_encode(old, new), repeats)
    a_work = {k: v.clone() for k, v in old.items()}
    a_dec = timed(lambda: astraflow_decode(a_work, a_enc[2]), repeats)
    astraflow = row(sum(len(r) for _, r in a_enc[2]), a_enc, a_dec, {"bit_exact": same_bits(a_work, new)})

    z_enc = timed(lambda: zstd_encode(new, 1), repeats)
    z_dec = timed(lambda: zstd_decode(z_enc[2]), repeats)
    zstd_full = row(sum(len(r) for _, r in z_enc[2]), z_enc, z_dec, {"level": 1})

    return {
        "params": numel,
        "full_bf16_bytes": full,
        "changed_params": changed,
        "sparsity": round(1 - changed / numel, 6),
        "ours": ours,
        "astraflow_u32_bf16": astraflow,
        "zstd_full": zstd_full,
        "bytes_vs_astraflow": round(len(delta) / astraflow["bytes"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adam-warmup", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    old, new = synthetic_step(args.seed, args.adam_warmup)
    print(f"synthetic workload built in {time.perf_counter() - t0:.1f}s", flush=True)
    synthetic = measure(old, new, args.repeats)
    print(json.dumps({"synthetic": synthetic}), flush=True)
    del old, new

    real = {}
    for lr, before, after in real_steps(args.seed, [1e-6, 1e-5]):
        real[f"lr_{lr:g}"] = measure(before, after, args.repeats)
        print(json.dumps({f"real_lr_{lr:g}": real[f"lr_{lr:g}"]}), flush=True)

    ours = synthetic["ours"]
    print(json.dumps({
        "benchmark": "delta_codec",
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "synthetic": synthetic,
        "real_model": real,
        "targets": {
            "synthetic_sparsity": synthetic["sparsity"],
            "pct_of_full<=1.3": ours["pct_of_full"] <= 1.3,
            "encode_gbps>=0.5": ours["encode_gbps"] >= 0.5,
            "decode_gbps>=0.5": ours["decode_gbps"] >= 0.5,
            "decode_copy_gbps>=0.5": ours["decode_copy_gbps"] >= 0.5,
            "bit_exact": ours["bit_exact"] and all(r["ours"]["bit_exact"] for r in real.values()),
        },
    }))


if __name__ == "__main__":
    main()
