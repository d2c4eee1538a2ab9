"""Publishing from a rank group: gather on rank 0 vs per-rank deltas of the shards, at Qwen2.5-1.5B shapes.

    nice -n 10 python benchmarks/publish_sharded.py [--layers 28] [--ranks 2] [--versions 3] [--changed 0.01]

The state is the bf16 state dict of Qwen2.5-1.5B's tensor shapes (hidden 1536, intermediate 8960,
12 heads / 2 KV heads of 128, vocab 151936, tied embeddings: no ``lm_head``; ``--layers`` scales the
depth down for a quick run), in HF names. Each of ``--ranks`` gloo ranks (started by
torch.distributed's elastic agent, the launcher ``astraflow run`` uses for ``trainer.ranks``) holds an
FSDP-style shard of every tensor: rows ``[r * ceil(n / N), (r + 1) * ceil(n / N))`` of dim 0 (the last
shard padded for the gather when n does not divide), generated on that rank (seeded by tensor and
rank; no process ever builds the full state before it is published). Between versions each rank moves
``--changed`` of every shard's entries by one bf16 step (bit pattern + 1: the synthetic update of
``benchmarks/weight_refresh.py``), seeded by (version, rank, tensor), so both modes see the same bits.

Two modes, each in fresh processes against one private embedded stack (broker + S3 server):

* ``gather`` (what the trainer does today): per tensor, ``dist.gather`` of the shards (as raw bytes)
  into rank 0's full tensor, then rank 0's :class:`astraflow.delta.WeightPublisher` publishes the
  version (encode against the previous version, upload, manifest, announcement) and is flushed.
* ``per_rank``: each rank encodes its shard against its previous shard with the same codec
  (:func:`astraflow.delta.encode`) and uploads its part (``v<N>/delta.rank<r>-of-<N>.zst``) in
  parallel; rank 0 gathers the parts' keys, sizes, sha256 and per-shard CRC-32C (the delta headers'),
  writes one manifest listing them (``v<N>/parts.json``, conditional put, as manifests are), and
  announces it on the log. The store's :class:`~astraflow.delta.Manifest` names one delta object and one
  CRC per *full* tensor, so it cannot express this: the manifest here is the benchmark's own, and
  using this path for real needs a manifest format change (parts + per-shard CRCs).

v0 is not timed. In ``per_rank`` it is an anchor: per rank, a safetensors file of the shard. In
``gather`` rank 0's publisher takes the gathered v0 as already published (``assume_published``, as a
trainer resuming from the store does), so no 3 GB anchor is written: the ``per_rank`` anchor parts,
concatenated, are its base in the check below, which the first delta verifies (CRC-32C of every base
tensor). v1 is a warm-up delta; the next ``--versions`` are measured. Per mode: wall
seconds per version (barrier to barrier, all ranks; median), its parts (gather / publish; encode /
upload / manifest + announce, slowest rank), bytes uploaded per version (deltas + manifest), and each
rank's peak RSS (over its life, and over the delta versions only: the kernel's mark reset after v0).
Then, in the main process, bit-exactness: the full state rebuilt from ``per_rank``'s parts (each
rank's anchor + its deltas, compared with its rows) against the state ``gather`` published (v0 + its
deltas read back from the bucket), tensor by tensor, bit for bit; and that state against the published
manifest's CRC-32C per tensor. Rank 0's peak RSS in ``gather`` includes memory glibc keeps after it
is freed (``MALLOC_MMAP_THRESHOLD_=1048576`` brings it down to the live data, at some speed). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

# hidden, intermediate, q heads, kv heads, head dim, vocab (Qwen2.5-1.5B config.json); tied embeddings
QWEN25_15B = {"hidden": 1536, "intermediate": 8960, "heads": 12, "kv_heads": 2, "head_dim": 128, "vocab": 151936,
              "layers": 28, "tied_embeddings": True}
GATHER_POLICY, PER_RANK_POLICY = "gathered", "sharded"


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    s = QWEN25_15B
    h, i, q, kv = s["hidden"], s["intermediate"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s["vocab"], h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        out.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    out["model.norm.weight"] = (h,)
    return out


def rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """FSDP2's dim-0 split: ceil(n / world) rows per rank, the last ranks short (or empty)."""
    chunk = math.ceil(n / world)
    return min(n, rank * chunk), min(n, (rank + 1) * chunk)


def make_shards(layers: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    out = {}
    for k, (name, shape) in enumerate(shapes(layers).items()):
        lo, hi = rows(shape[0], rank, world)
        g = torch.Generator().manual_seed(1_000_003 * k + rank)
        if name.endswith("norm.weight"):
            out[name] = torch.ones((hi - lo, *shape[1:]), dtype=torch.bfloat16)
        else:
            out[name] = (torch.randn((hi - lo, *shape[1:]), generator=g) * 0.02).to(torch.bfloat16)
    return out


def train_step(shards: dict[str, torch.Tensor], version: int, rank: int, changed: float) -> None:
    """``changed`` of each shard's entries moved by one bf16 step, in place (seeded: same bits in both modes)."""
    for k, t in enumerate(shards.values()):
        flat = t.view(torch.int16).view(-1)
        if flat.numel() == 0:
            continue
        g = torch.Generator().manual_seed(7_919 * version + 104_729 * k + rank)
        idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * changed)),), generator=g)
        flat[idx] += 1


_PEAK_BEFORE_RESET = [0]


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM, also getrusage's ru_maxrss) of this process, so that
    :func:`peak_rss` then covers the delta versions only (not v0's anchor or hand-off); the peak so far
    is kept for :func:`life_peak_rss`."""
    _PEAK_BEFORE_RESET[0] = max(_PEAK_BEFORE_RESET[0], peak_rss() or 0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def life_peak_rss() -> int:
    return max(_PEAK_BEFORE_RESET[0], peak_rss() or 0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def part_key(layout, policy: str, version: int, rank: int, world: int, kind: str) -> str:
    suffix = "safetensors" if kind == "anchor" else "zst"
    return f"{layout.version_prefix(policy, version)}{kind}.rank{rank}-of-{world}.{suffix}"


def parts_manifest_key(layout, policy: str, version: int) -> str:
    return f"{layout.version_prefix(policy, version)}parts.json"


# -- one rank (a process started by the elastic agent) ----------------------------------------------
def _worker(mode: str, state_dir: str, run: str, layers: int, changed: float, versions: int, threads: int) -> dict:
    import torch.distributed as dist

    from astraflow.config import ClusterConfig

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ClusterConfig(state_dir=Path(state_dir)).resolve().model_copy(update={"run": run})
    t0 = time.perf_counter()
    shards = make_shards(layers, rank, world)
    init_s = time.perf_counter() - t0
    run_versions = gather_mode if mode == "gather" else per_rank_mode
    per_version, anchor_s = run_versions(cfg, shards, rank, world, layers, changed, versions)
    out = {"rank": rank, "init_s": init_s, "anchor_s": anchor_s, "versions": per_version,
           "shard_bytes": sum(t.numel() * t.element_size() for t in shards.values()),
           "max_rss_bytes": life_peak_rss(), "delta_peak_rss_bytes": peak_rss()}
    dist.barrier()
    dist.destroy_process_group()
    return out


def gather_full(shards: dict[str, torch.Tensor], rank: int, world: int, layers: int) -> dict[str, torch.Tensor]:
    """Every tensor gathered whole on rank 0 (as raw bytes: gloo has no 16-bit integers; into its final storage when n divides)."""
    import torch.distributed as dist

    full: dict[str, torch.Tensor] = {}
    for name, shape in shapes(layers).items():
        chunk = math.ceil(shape[0] / world)
        row = (*shape[1:-1], shape[-1] * 2) if len(shape) > 1 else (2,)  # one row's bytes
        mine = shards[name].reshape(-1, *shape[1:]).view(torch.uint8).reshape(-1, *row)
        if mine.shape[0] < chunk:  # a short last shard: padded to the common size
            mine = torch.cat([mine, mine.new_zeros((chunk - mine.shape[0], *row))])
        if rank == 0:
            padded = chunk * world != shape[0]
            out = torch.empty((chunk * world, *row), dtype=torch.uint8)
            dist.gather(mine.contiguous(), list(out.chunk(world)), dst=0)
            out = out[: shape[0]].clone() if padded else out
            full[name] = out.view(torch.bfloat16).reshape(shape)
        else:
            dist.gather(mine.contiguous(), None, dst=0)
    return full


def gather_mode(cfg, shards, rank, world, layers, changed, versions):
    import torch.distributed as dist

    from astraflow.delta import WeightPublisher

    publisher = WeightPublisher(cfg, GATHER_POLICY, anchor_every=10**9, max_lag_versions=1) if rank == 0 else None
    rows_out, anchor_s = [], None
    try:
        for v in range(versions + 2):
            if v:
                train_step(shards, v, rank, changed)
            dist.barrier()
            t0 = time.perf_counter()
            full = gather_full(shards, rank, world, layers)
            t1 = time.perf_counter()
            if publisher is not None:
                if v == 0:  # the base of v1, taken as already published (see the module docstring)
                    publisher.assume_published(full, 0)
                else:
                    publisher.publish(full, v, owned=True)  # fresh tensors: no snapshot copy
                del full
                publisher.flush()
            t2 = time.perf_counter()
            dist.barrier()
            t3 = time.perf_counter()
            if v == 0:
                anchor_s = t3 - t0
                reset_peak_rss()
            else:
                rows_out.append({"version": v, "total_s": t3 - t0, "gather_s": t1 - t0, "publish_s": t2 - t1})
    finally:
        if publisher is not None:
            publisher.close()
    return rows_out, anchor_s


def per_rank_mode(cfg, shards, rank, world, layers, changed, versions):
    import torch.distributed as dist
    from safetensors.torch import save_file

    from astraflow.delta import WeightStore, encode, read_header
    from astraflow.log import LogProducer, Topics, ensure_topics
    from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA
    from astraflow.objstore import publish_manifest
    from astraflow.records.control import WeightAnnouncement

    store = WeightStore.from_config(cfg, PER_RANK_POLICY)
    objects, layout = store.objects, store.layout
    producer = topic = None
    if rank == 0:
        topic = Topics(cfg.run).weights(PER_RANK_POLICY)
        ensure_topics(cfg, {topic: 1})
        producer = LogProducer(cfg, f"weights-publisher-{PER_RANK_POLICY}", linger_ms=0)
    rows_out, anchor_s, prev = [], None, None
    try:
        for v in range(versions + 2):
            if v:
                prev = {k: t.clone() for k, t in shards.items()}  # the previous published shard (untimed)
                train_step(shards, v, rank, changed)
            dist.barrier()
            t0 = time.perf_counter()
            if v == 0:  # a per-rank anchor: the shard as safetensors
                key = part_key(layout, PER_RANK_POLICY, v, rank, world, "anchor")
                with tempfile.TemporaryDirectory(prefix="af-part-") as tmp:
                    path = Path(tmp) / "part.safetensors"
                    save_file(shards, str(path))
                    t1 = time.perf_counter()
                    sha = objects.put_file(key, path)
                    size = path.stat().st_size
                crcs = None
            else:
                blob = encode(prev, shards, base_version=v - 1, target_version=v)
                header = read_header(blob)
                crcs = {e.name: e.crc_target for e in header.tensors}
                t1 = time.perf_counter()
                key = part_key(layout, PER_RANK_POLICY, v, rank, world, "delta")
                sha, size = objects.put_bytes(key, blob), len(blob)
                del blob
            t2 = time.perf_counter()
            part = {"rank": rank, "key": key, "bytes": size, "sha256": sha, "shard_crc32c": crcs,
                    "rows": {n: list(rows(s[0], rank, world)) for n, s in shapes(layers).items()}}
            parts = [None] * world if rank == 0 else None
            dist.gather_object(part, parts, dst=0)
            manifest_bytes = 0
            if rank == 0:
                manifest = {"format": "per-rank-parts/benchmark", "policy": PER_RANK_POLICY, "version": v,
                            "base": v - 1 if v else None, "kind": "delta" if v else "anchor", "world_size": world,
                            "split": "dim0, ceil(n / world_size) rows per rank",
                            "tensors": {n: {"dtype": "bfloat16", "shape": list(s)} for n, s in shapes(layers).items()},
                            "parts": parts}
                mkey = parts_manifest_key(layout, PER_RANK_POLICY, v)
                publish_manifest(objects, mkey, manifest)
                manifest_bytes = len(json.dumps(manifest, sort_keys=True, separators=(",", ":")))
                announcement = WeightAnnouncement(version=v, policy=PER_RANK_POLICY, kind=manifest["kind"], manifest=mkey,
                                                  bytes=sum(p["bytes"] for p in parts), checksum=sha)
                producer.send_json(topic, str(v), announcement.model_dump(mode="json", exclude_none=True),
                                   schema_name=WEIGHT_ANNOUNCEMENT_SCHEMA[0], schema_version=WEIGHT_ANNOUNCEMENT_SCHEMA[1],
                                   policy=PER_RANK_POLICY).result(timeout=30)
            t3 = time.perf_counter()
            dist.barrier()
            t4 = time.perf_counter()
            if v == 0:
                anchor_s = t4 - t0
                reset_peak_rss()
            else:
                rows_out.append({"version": v, "total_s": t4 - t0, "encode_s": t1 - t0, "upload_s": t2 - t1,
                                 "manifest_s": t3 - t2, "part_bytes": size, "manifest_bytes": manifest_bytes})
            prev = None
    finally:
        if producer is not None:
            producer.close()
    return rows_out, anchor_s


def launch(ranks: int, *args) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=uuid.uuid4().hex[:8],
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
                          monitor_interval=0.1)
    return elastic_launch(config, _worker)(*args)


# -- bit-exactness (main process, after both modes' ranks have exited) ----------------------------------
def verify(cfg, layers: int, world: int, last: int) -> dict:
    from safetensors.torch import load_file

    from astraflow.delta import WeightStore, apply_inplace
    from astraflow.delta.parts import apply_parts_inplace
    from astraflow.delta.store import check_state

    sharded = WeightStore.from_config(cfg, PER_RANK_POLICY)
    objects, layout = sharded.objects, sharded.layout
    part_states = []
    for r in range(world):
        with tempfile.TemporaryDirectory(prefix="af-part-") as tmp:
            path = Path(tmp) / "part.safetensors"
            objects.get_file(part_key(layout, PER_RANK_POLICY, 0, r, world, "anchor"), path)
            part_states.append(load_file(str(path)))
    # v0, whole: the base of the gather mode's first delta (which checks it bit for bit: CRC-32C of its base)
    state = {name: torch.cat([p[name] for p in part_states]) for name in shapes(layers)}
    for r, part in enumerate(part_states):
        for v in range(1, last + 1):
            manifest = objects.get_json(parts_manifest_key(layout, PER_RANK_POLICY, v))
            entry = manifest["parts"][r]
            blob, sha = objects.get_bytes_with_sha256(entry["key"])
            if sha != entry["sha256"]:
                raise RuntimeError(f"part {entry['key']} is not the object its manifest names")
            apply_inplace(part, blob, base_version=v - 1)
    gathered = WeightStore.from_config(cfg, GATHER_POLICY)
    for v in range(1, last + 1):
        apply_parts_inplace(state, gathered.get_delta(v), v - 1)
    check_state(state, gathered.manifest(last))  # the published manifest's CRC-32C of every tensor
    # the full state per_rank's parts make (each rank's rows), bit for bit against gather's
    same = set(state) == set(shapes(layers))
    for name, shape in shapes(layers).items():
        for r, part in enumerate(part_states):
            lo, hi = rows(shape[0], r, world)
            mine, whole = part[name], state[name][lo:hi]
            same = same and mine.dtype == whole.dtype and mine.shape == whole.shape and torch.equal(
                mine.view(torch.int16), whole.view(torch.int16))
    return {"bit_exact": same, "tensors": len(state), "checked_version": last,
            "manifest_crc32c_match": True, "manifest_state_digest": gathered.manifest(last).state_digest}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=QWEN25_15B["layers"], help="decoder layers (28: Qwen2.5-1.5B)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--versions", type=int, default=3, help="measured versions (after the anchor and one warm-up)")
    ap.add_argument("--changed", type=float, default=0.01, help="share of each tensor's entries changed per version")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args(argv)
    threads = max(1, args.cores // args.ranks)
    sh = shapes(args.layers)
    params = sum(math.prod(s) for s in sh.values())
    full_gb = params * 2 / 1e9
    print(f"{params / 1e9:.3f} B parameters ({args.layers} layers), {full_gb:.2f} GB in bf16; expected peak RSS: "
          f"gather rank 0 ~{full_gb * (2 + 1 / args.ranks):.1f} GB (shard + gathered + publisher's previous) + ~1 GB of torch, "
          f"per_rank ~{2 * full_gb / args.ranks:.1f} GB a rank (shard + previous shard); verify ~{2 * full_gb:.1f} GB",
          file=sys.stderr, flush=True)

    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack

    result: dict = {"benchmark": "publish_sharded", "model": "Qwen2.5-1.5B shapes", "shapes": QWEN25_15B | {"layers": args.layers},
                    "layers": args.layers, "ranks": args.ranks, "params": params, "full_bf16_bytes": params * 2,
                    "changed": args.changed, "versions_measured": args.versions, "cores": args.cores,
                    "threads_per_rank": threads, "backend": "gloo (CPU)",
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="af-pubshard-") as tmp:
        stack, _ = EmbeddedStack.start_private(Path(tmp) / "stack")
        try:
            cfg = ClusterConfig(state_dir=Path(tmp) / "stack").resolve()
            run = f"pubshard-{uuid.uuid4().hex[:6]}"
            cfg = cfg.model_copy(update={"run": run})
            modes = {}
            for mode in ("gather", "per_rank"):
                t0 = time.perf_counter()
                per_rank = launch(args.ranks, mode, str(Path(tmp) / "stack"), run, args.layers, args.changed,
                                  args.versions, threads)
                figs = [per_rank[r] for r in sorted(per_rank)]
                measured = [[row for row in f["versions"]][1:] for f in figs]  # v1 is the warm-up delta
                total = [max(rs[i]["total_s"] for rs in measured) for i in range(args.versions)]
                m = {"s_per_version": round(statistics.median(total), 3), "s_per_version_all": [round(x, 3) for x in total],
                     "v0_s": round(max(f["anchor_s"] for f in figs), 2),
                     "max_rss_mib_per_rank": [round(f["max_rss_bytes"] / 2**20) for f in figs],
                     "delta_versions_peak_rss_mib_per_rank": [round(f["delta_peak_rss_bytes"] / 2**20)
                                                              if f["delta_peak_rss_bytes"] else None for f in figs],
                     "shard_bytes_per_rank": [f["shard_bytes"] for f in figs], "wall_s": round(time.perf_counter() - t0, 1)}
                if mode == "gather":
                    r0 = measured[0]
                    m["gather_s"] = round(statistics.median(r["gather_s"] for r in r0), 3)
                    m["publish_s"] = round(statistics.median(r["publish_s"] for r in r0), 3)
                else:
                    for part in ("encode_s", "upload_s"):
                        m[part + "_slowest_rank"] = round(statistics.median(
                            max(rs[i][part] for rs in measured) for i in range(args.versions)), 3)
                    m["manifest_announce_s"] = round(statistics.median(r["manifest_s"] for r in measured[0]), 3)
                modes[mode] = m
                print(f"{mode}: {m}", file=sys.stderr, flush=True)
            last = args.versions + 1
            # bytes uploaded per measured version: the deltas + the manifest
            from astraflow.delta import WeightStore

            gstore = WeightStore.from_config(cfg, GATHER_POLICY)
            gstore_objects = gstore.objects
            g_bytes = [gstore.manifest(v).bytes + gstore_objects.size(gstore.layout.manifest_key(GATHER_POLICY, v))
                       for v in range(2, last + 1)]
            s_bytes = []
            for v in range(2, last + 1):
                mk = parts_manifest_key(gstore.layout, PER_RANK_POLICY, v)
                s_bytes.append(sum(p["bytes"] for p in gstore_objects.get_json(mk)["parts"]) + gstore_objects.size(mk))
            modes["gather"]["bytes_per_version"] = int(statistics.median(g_bytes))
            modes["per_rank"]["bytes_per_version"] = int(statistics.median(s_bytes))
            t0 = time.perf_counter()
            check = verify(cfg, args.layers, args.ranks, last)
            check["verify_s"] = round(time.perf_counter() - t0, 1)
            check["max_rss_mib_main"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        finally:
            stack.down()
    g, p = modes["gather"]["s_per_version"], modes["per_rank"]["s_per_version"]
    result.update({
        "gather_s": g, "per_rank_s": p,
        "bytes": {"gather": modes["gather"]["bytes_per_version"], "per_rank": modes["per_rank"]["bytes_per_version"]},
        "faster": "per_rank" if p < g else "gather", "speedup": round(max(g, p) / min(g, p), 2),
        "bit_exact": check["bit_exact"], "verify": check, "modes": modes,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "notes": "wall s per version = barrier to barrier over all ranks, median of the measured versions; "
                 "per_rank's manifest is the benchmark's own (the store's Manifest names one delta object)",
    })
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
