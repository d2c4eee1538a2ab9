"""Step end -> a node serving the new weights, through the product's weight plane, at Qwen2.5 shapes.

    nice -n 10 python benchmarks/weight_sync.py [--models 0.5b,1.5b] [--modes one,gather,parts] [--versions 2] [--device cpu]

A trainer's weights (random bf16 tensors with the shapes of Qwen2.5-0.5B / 1.5B, HF names, tied
embeddings: ``benchmarks/weight_refresh.py``'s shapes), each version moving ``--changed`` of every
tensor's entries by one bf16 step (seeded per 256-row block, so every mode publishes the same bits),
are published by :class:`astraflow.delta.WeightPublisher` into a private embedded stack (real S3 server
and broker), in three modes, each a fresh group of gloo ranks started by torch's elastic agent:

* ``one``: one rank publishes the whole state (the one-part case);
* ``gather`` (the baseline: a rank group without parts): 2 ranks each hold their FSDP rows
  (``ceil(n / 2)`` of dim 0), gather them to rank 0 (``dist.gather`` of the raw bytes), which publishes;
* ``parts``: 2 ranks each publish their own rows as their part (:mod:`astraflow.delta.parts`), rank 0
  writing the manifest once both parts are in.
* ``host``: one rank whose weights are on ``--device`` copies them to the host and publishes that (a CUDA
  trainer's path with ``trainer.encode_weights_on: host``, the baseline of ``one`` on a GPU, which
  encodes where the weights are: diff, gap coding, byte planes and CRC-32C on the GPU).

``--device cuda``: the trainer's and the node's tensors live on the GPU (modes ``one,host``).

v0 (the anchor) and v1 (warm-up) are not timed; ``--versions`` more are. Trainer side, per version
(rank 0's figures; ``encode`` / ``upload`` the slowest rank's): ``snapshot`` (the caller blocked in
``publish``: the host copy), ``gather`` (gather mode), ``encode`` (CRCs + delta), ``upload`` (the part's
objects and record), ``parts_wait`` (rank 0 waiting for the other part), ``announce`` (manifest +
announcement acknowledged), and ``step_end_to_announced`` (wall clock, all of it). Node side, measured
in this process once the ranks are done (so not overlapped with them on this shared machine): a
subscriber holding v-1 in the tensors it serves from takes v as the node's in-place path does:
``fetch`` (the manifest and every delta part, sha256-checked), ``decode`` (checks and decode into one
change per tensor, :func:`astraflow.delta.patch.prepare_patch`: beside serving), ``swap`` (the writes:
the only time the engine pauses), then verifies the whole tensors' CRC-32C. ``step_end_to_serving`` =
step end -> announced + fetch + decode + swap (the announcement's delivery over the broker is not in
it; ``benchmarks/weight_refresh.py`` measures that path). Also: bytes per version, each rank's peak
RSS over the delta versions, and whether every mode published the same state digest for every
version (bit-exact; the node's CRCs checked against it). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from publish_sharded import life_peak_rss, peak_rss, reset_peak_rss
from weight_refresh import SHAPES

BLOCK = 256
"""Rows per seeded block: the bits of a row do not depend on how the ranks split the tensor."""
RANKS = {"one": 1, "host": 1, "gather": 2, "parts": 2}


def model_shapes(model: str) -> dict[str, list[int]]:
    """The tensor shapes of ``weight_refresh.qwen2_state(model)``, without making the tensors."""
    hidden, inter, layers, heads, kv, hd, vocab = SHAPES[model]
    out = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": [heads * hd, hidden], p + "self_attn.q_proj.bias": [heads * hd],
            p + "self_attn.k_proj.weight": [kv * hd, hidden], p + "self_attn.k_proj.bias": [kv * hd],
            p + "self_attn.v_proj.weight": [kv * hd, hidden], p + "self_attn.v_proj.bias": [kv * hd],
            p + "self_attn.o_proj.weight": [hidden, heads * hd],
            p + "mlp.gate_proj.weight": [inter, hidden], p + "mlp.up_proj.weight": [inter, hidden],
            p + "mlp.down_proj.weight": [hidden, inter],
            p + "input_layernorm.weight": [hidden], p + "post_attention_layernorm.weight": [hidden],
        })
    return out


def _blocks(shape: list[int], lo: int, hi: int):
    for b in range(lo // BLOCK, -(-hi // BLOCK)):
        b_lo, b_hi = b * BLOCK, min((b + 1) * BLOCK, shape[0])
        yield b, b_lo, b_hi, max(lo, b_lo), min(hi, b_hi)


def make_rows(shapes: dict[str, list[int]], rank: int, ranks: int) -> tuple[dict[str, torch.Tensor], dict]:
    from astraflow.delta.parts import chunk_rows

    tensors, rows = {}, {}
    for k, (name, shape) in enumerate(shapes.items()):
        lo, hi = chunk_rows(shape[0], rank, ranks)
        if hi <= lo:
            continue
        out = torch.empty((hi - lo, *shape[1:]), dtype=torch.bfloat16)
        for b, b_lo, b_hi, s_lo, s_hi in _blocks(shape, lo, hi):
            g = torch.Generator().manual_seed(1_000_003 * k + b)
            block = (torch.randn((b_hi - b_lo, *shape[1:]), generator=g) * 0.02).to(torch.bfloat16)
            out[s_lo - lo: s_hi - lo] = block[s_lo - b_lo: s_hi - b_lo]
        tensors[name], rows[name] = out, (lo, hi)
    return tensors, rows


def train_step(tensors: dict[str, torch.Tensor], rows: dict, shapes: dict, version: int, changed: float) -> None:
    """``changed`` of each block's entries moved by one bf16 step (the same entries whatever the split)."""
    for k, (name, shape) in enumerate(shapes.items()):
        if name not in tensors:
            continue
        lo, hi = rows[name]
        mine = tensors[name].view(torch.int16).reshape(hi - lo, -1)
        for b, b_lo, b_hi, s_lo, s_hi in _blocks(shape, lo, hi):
            width = mine.shape[1]
            n = (b_hi - b_lo) * width
            g = torch.Generator().manual_seed(7_919 * version + 104_729 * k + b)
            idx = torch.randint(0, n, (max(1, int(n * changed)),), generator=g)
            r, c = idx // width + b_lo, idx % width
            keep = (r >= s_lo) & (r < s_hi)
            mine[(r[keep] - lo).to(mine.device), c[keep].to(mine.device)] += 1


def gather_whole(tensors: dict[str, torch.Tensor], shapes: dict, rank: int, ranks: int) -> dict[str, torch.Tensor]:
    """Every tensor gathered whole on rank 0 (raw bytes, the short last shard padded)."""
    import torch.distributed as dist

    from astraflow.delta.parts import chunk_rows

    full = {}
    for name, shape in shapes.items():
        chunk = chunk_rows(shape[0], 0, ranks)[1]
        width = 2 * (tensors[name][0].numel() if name in tensors else int(torch.tensor(shape[1:]).prod()))
        mine = tensors[name].reshape(-1).view(torch.uint8).reshape(-1, width) if name in tensors else \
            torch.empty((0, width), dtype=torch.uint8)
        if mine.shape[0] < chunk:
            mine = torch.cat([mine, mine.new_zeros((chunk - mine.shape[0], width))])
        if rank == 0:
            out = torch.empty((chunk * ranks, width), dtype=torch.uint8)
            dist.gather(mine.contiguous(), list(out.chunk(ranks)), dst=0)
            full[name] = out[: shape[0]].clone().view(torch.bfloat16).reshape(shape)
        else:
            dist.gather(mine.contiguous(), None, dst=0)
    return full


def _worker(mode: str, state_dir: str, run: str, model: str, changed: float, versions: int, threads: int,
            device: str) -> dict:
    import torch.distributed as dist

    from astraflow.config import ClusterConfig
    from astraflow.delta import WeightPublisher
    from astraflow.delta.parts import PartOf

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    cfg = ClusterConfig(state_dir=Path(state_dir)).resolve().model_copy(update={"run": run})
    shapes = model_shapes(model)
    tensors, rows = make_rows(shapes, rank, ranks)
    tensors = {name: t.to(device) for name, t in tensors.items()}
    publisher = None
    if mode == "parts":
        publisher = WeightPublisher(cfg, mode, anchor_every=10**9, max_lag_versions=1,
                                    part=PartOf(rank, ranks, run))
    elif rank == 0:
        publisher = WeightPublisher(cfg, mode, anchor_every=10**9, max_lag_versions=1)
    measured = []
    try:
        for v in range(versions + 2):
            if v:
                train_step(tensors, rows, shapes, v, changed)
                if device != "cpu":
                    torch.cuda.synchronize()  # the step has ended when its writes have
            dist.barrier()
            step_end, t0 = time.time(), time.perf_counter()
            figures = {"version": v}
            if mode == "parts":
                publisher.publish(tensors, v, rows=rows, shapes=shapes)
            else:
                whole = tensors if mode in ("one", "host") else gather_whole(tensors, shapes, rank, ranks)
                if mode == "gather":
                    figures["gather"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                if mode == "host":  # the weights copied to the host first: a CUDA trainer's path before device encode
                    whole = {name: t.to("cpu", copy=True) for name, t in whole.items()}
                if publisher is not None:
                    publisher.publish(whole, v, owned=mode in ("gather", "host"))
                del whole
            figures["snapshot"] = time.perf_counter() - t0
            if publisher is not None:
                publisher.flush()
                figures.update(publisher.stage_s.get(v, {}))
                if v in publisher.announced_at:
                    figures["step_end_to_announced"] = publisher.announced_at.pop(v) - step_end
            dist.barrier()
            if v == 0:
                reset_peak_rss()
            elif v >= 2:
                measured.append(figures)
    finally:
        if publisher is not None:
            publisher.close()
    out = {"rank": rank, "versions": measured, "peak_rss_bytes": peak_rss(), "life_peak_rss_bytes": life_peak_rss(),
           "rows_bytes": sum(t.numel() * 2 for t in tensors.values())}
    dist.barrier()
    dist.destroy_process_group()
    return out


def launch(ranks: int, *args) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=uuid.uuid4().hex[:8],
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
                          monitor_interval=0.1)
    return elastic_launch(config, _worker)(*args)


def node_side(cfg, mode: str, first: int, last: int, device: str) -> list[dict]:
    """A node holding ``first - 1`` in its serving tensors takes each version up to ``last`` in place."""
    from astraflow.delta import WeightStore, WeightSubscriber
    from astraflow.delta.patch import prepare_patch

    sub = WeightSubscriber(cfg, mode, f"node-{mode}", register=False)
    live = sub.pull(first - 1)[0]  # the subscriber's own tensors: served from, patched in place
    live = {name: t.to(device) for name, t in live.items()}
    store = sub.store
    out = []
    for v in range(first, last + 1):
        fresh = WeightStore(store.objects, store.layout.run, mode)  # no manifest cached: read it, as a node would
        t0 = time.perf_counter()
        manifest = fresh.manifest(v)
        parts = fresh.get_delta(v)
        t1 = time.perf_counter()
        patch = prepare_patch(live, [(v, parts, manifest.tensors)], v - 1)
        t2 = time.perf_counter()
        patch.write(live)  # the pause
        if device != "cpu":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        bad = patch.verify(live)
        out.append({"version": v, "fetch": t1 - t0, "decode": t2 - t1, "swap": t3 - t2, "verified": not bad,
                    "bytes": manifest.bytes, "parts": len(manifest.parts), "state_digest": manifest.state_digest})
    return out


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--modes", default="one,gather,parts")
    ap.add_argument("--versions", type=int, default=2, help="measured versions (after the anchor and a warm-up)")
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--device", default="cpu", help="where the trainer's and the node's weights live (cuda: one "
                    "rank; modes one = encode on the GPU, host = copy to the host first, today's CUDA path)")
    args = ap.parse_args(argv)

    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack

    result: dict = {"benchmark": "weight_sync", "changed": args.changed, "versions_measured": args.versions,
                    "cores": args.cores, "device": args.device,
                    "gpu": torch.cuda.get_device_name(0) if args.device != "cpu" else None, "backend": "gloo", "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                    "models": {}}
    last = args.versions + 1
    with tempfile.TemporaryDirectory(prefix="af-wsync-") as tmp:
        stack, _ = EmbeddedStack.start_private(Path(tmp) / "stack")
        try:
            base = ClusterConfig(state_dir=Path(tmp) / "stack").resolve()
            for model in args.models.split(","):
                shapes = model_shapes(model)
                params = sum(int(torch.tensor(s).prod()) for s in shapes.values())
                figs: dict = {"params": params, "full_bf16_bytes": 2 * params}
                digests = {}
                for mode in args.modes.split(","):
                    ranks = RANKS[mode]
                    run = f"wsync-{model.replace('.', '')}-{uuid.uuid4().hex[:6]}"
                    cfg = base.model_copy(update={"run": run})
                    t0 = time.perf_counter()
                    by_rank = launch(ranks, mode, str(Path(tmp) / "stack"), run, model, args.changed, args.versions,
                                     max(1, args.cores // ranks), args.device)
                    r0 = by_rank[0]["versions"]
                    slowest = [max((by_rank[r]["versions"][i].get(k, 0.0) for r in by_rank), default=0.0)
                               for i in range(len(r0)) for k in ("encode", "upload")]
                    node = node_side(cfg, mode, 2, last, args.device)
                    total = [r0[i]["step_end_to_announced"] + node[i]["fetch"] + node[i]["decode"] + node[i]["swap"]
                             for i in range(len(node))]
                    m = {"ranks": ranks, "step_end_to_serving_s": round(statistics.median(total), 3),
                         "step_end_to_serving_all": [round(x, 3) for x in total],
                         "stages_s": {k: _median(r0, k) for k in ("snapshot", "gather", "encode", "upload",
                                                                  "parts_wait", "announce", "step_end_to_announced")}
                         | {k: _median(node, k) for k in ("fetch", "decode", "swap")},
                         "encode_upload_slowest_rank_s": [round(x, 3) for x in slowest],
                         "engine_pause_s": _median(node, "swap"),
                         "bytes_per_version": int(statistics.median(n["bytes"] for n in node)),
                         "parts": node[0]["parts"], "node_verified": all(n["verified"] for n in node),
                         "peak_rss_mib_per_rank": [round(by_rank[r]["peak_rss_bytes"] / 2**20) for r in sorted(by_rank)],
                         "life_peak_rss_mib_per_rank": [round(by_rank[r]["life_peak_rss_bytes"] / 2**20)
                                                        for r in sorted(by_rank)],
                         "wall_s": round(time.perf_counter() - t0, 1)}
                    digests[mode] = [n["state_digest"] for n in node]
                    figs[mode] = m
                    print(f"{model} {mode}: {json.dumps(m)}", file=sys.stderr, flush=True)
                figs["bit_exact_across_modes"] = len({tuple(d) for d in digests.values()}) == 1
                result["models"][model] = figs
        finally:
            stack.down()
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["notes"] = ("node stages measured after the trainer's (not overlapped); step_end_to_serving excludes "
                       "the announcement's delivery over the broker; rank 0's peak RSS is over the delta versions")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
