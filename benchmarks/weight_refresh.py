"""Weight refresh at real model sizes: a delta through the real S3 vs the full checkpoint, one run.

Models with the layer shapes of Qwen2.5-0.5B and Qwen2.5-1.5B (random bf16 init; tied embeddings).
The trainer side is :class:`astraflow.delta.WeightPublisher` (anchor v0, then v1 = the ~99%-sparse
synthetic update: ``--changed`` of each tensor's entries moved by one bf16 step); the node side is
:class:`astraflow.delta.WeightSubscriber`, which holds v0 and is brought to v1 in place in the
tensors an engine would serve from (a state dict here: no generation runs, so "paused" is the time
the serving tensors are being written).

Per model: trainer blocked time in ``publish`` (the snapshot), publish time (encode + upload +
manifest + announcement, on the publisher's thread), announcement -> applied (the announcement
record's timestamp to the end of the in-place apply on the node, including its fetch of the
announcement), bytes of the delta against the full bf16 size, and the same refresh through the full
checkpoint (the anchor: upload, then download + load), measured side by side. Then v2 through the
engine-side patch path (:mod:`astraflow.delta.patch`: fetch + decode off to the side, the engine
paused only while the changed entries are written, checksums verified after), reported as
``patch`` next to v1's ``apply_inplace`` (the baseline: verify, write, verify, all paused), and
``cache_line_floor_s``: a strided pass touching as many cache lines as the patch writes, with no index
array (:func:`touch_floor_s`), which the pause cannot go below on this machine.
``--device cuda`` puts the serving tensors on a GPU (the trainer side stays on the host, as a
trainer's published copies are): the patch is then XORed in on the device, the timings wait for the
device, and there is no cache-line floor.
Prints one JSON line last.

    nice -n 10 python benchmarks/weight_refresh.py [--models 0.5b,1.5b] [--changed 0.01] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

SHAPES = {
    # hidden, intermediate, layers, q heads, kv heads, head dim, vocab (config.json of each model)
    "0.5b": (896, 4864, 24, 14, 2, 64, 151936),
    "1.5b": (1536, 8960, 28, 12, 2, 128, 151936),
    "tiny": (64, 128, 2, 4, 2, 16, 1000),  # a smoke test of the script
    "small": (256, 512, 2, 4, 2, 64, 4096),  # benchmarks/engines.py --patch-shape small on the CPU
}


def qwen2_state(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    hidden, inter, layers, heads, kv, hd, vocab = SHAPES[name]
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.q_proj.bias": w(heads * hd),
            p + "self_attn.k_proj.weight": w(kv * hd, hidden), p + "self_attn.k_proj.bias": w(kv * hd),
            p + "self_attn.v_proj.weight": w(kv * hd, hidden), p + "self_attn.v_proj.bias": w(kv * hd),
            p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    return state


def touch_floor_s(live: dict[str, torch.Tensor], changes: list, threads: int) -> float:
    """What the pause cannot go below on this machine: one read-modify-write (OR 0: the bits stay as
    they are) at every ``numel / changed``-th entry of each changed tensor, a strided pass with no index
    array. With the changes spread evenly (~100 entries apart at 1%, 200 bytes in bf16), the patch
    writes one entry per cache line and this pass touches as many lines, split over ``threads``."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    def touch(change) -> None:
        flat = live[change.name].view(torch.int16).reshape(-1).numpy()
        view = flat[:: max(1, flat.size // max(1, len(change.positions)))]
        np.bitwise_or(view, 0, out=view)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(touch, [c for c in changes if c.positions is not None]))
    return time.perf_counter() - t0


def sparse_update(state: dict[str, torch.Tensor], changed: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy with ``changed`` of each tensor's entries moved by one bf16 ulp (bit pattern + 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).flatten().clone()
        idx = torch.randperm(bits.numel(), generator=g)[: max(1, int(bits.numel() * changed))]
        bits[idx] += 1
        out[name] = bits.view(torch.bfloat16).view(t.shape)
    return out


class AnnouncementWatch:
    """Polls the weights topic on a thread of its own, as a node's weight follower does: a consumer
    left unpolled through a minute-long anchor upload would be dropped from its group and rejoin,
    which a node never does."""

    def __init__(self, consumer) -> None:
        self.consumer = consumer
        self.seen: dict[int, int] = {}  # version -> announcement timestamp (ms)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        from astraflow.records.control import WeightAnnouncement

        while not self._stop.is_set():
            for m in self.consumer.poll(0.2):
                if isinstance(m.record, WeightAnnouncement):  # parsed at decode
                    self.seen[m.record.version] = m.timestamp_ms

    def wait(self, version: int) -> int:
        while version not in self.seen:
            time.sleep(0.005)
        return self.seen[version]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.consumer.close()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously), so that a timing ends
    when the tensors are written."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def bench_model(cfg, name: str, changed: float, device: torch.device) -> dict:
    from astraflow.delta import WeightPublisher, WeightSubscriber
    from astraflow.log import LogConsumer, Topics
    from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA

    run_cfg = cfg.model_copy(update={"run": f"refresh-{name.replace('.', '')}-{uuid.uuid4().hex[:6]}"})
    policy = "policy"
    v0 = qwen2_state(name)
    params = sum(t.numel() for t in v0.values())
    v1 = sparse_update(v0, changed)
    out: dict = {"params": params, "full_bf16_mb": round(params * 2 / 1e6, 1)}
    print(f"{name}: {params / 1e9:.2f} B parameters", file=sys.stderr, flush=True)

    publisher = WeightPublisher(run_cfg, policy, anchor_every=1000, max_lag_versions=2)
    topic = Topics(run_cfg.run).weights(policy)
    announcements = AnnouncementWatch(LogConsumer(run_cfg, topic, f"{run_cfg.run}.bench",
                                                  {topic: WEIGHT_ANNOUNCEMENT_SCHEMA}, auto_offset_reset="earliest"))
    subscriber = WeightSubscriber(run_cfg, policy, "bench-node")
    try:
        # v0: the full checkpoint path (anchor upload by the publisher, download + load by the node)
        t0 = time.perf_counter()
        publisher.publish(v0, 0)
        publisher.flush()
        anchor_publish_s = time.perf_counter() - t0
        serving = {k: torch.empty_like(v, device=device) for k, v in v0.items()}  # the engine's own tensors
        t0 = time.perf_counter()
        _, anchor_bytes = subscriber.apply_to(serving, 0)  # no copy kept by the subscriber
        synchronize(device)
        anchor_pull_s = time.perf_counter() - t0
        out["full_checkpoint"] = {"publish_s": round(anchor_publish_s, 2), "pull_and_load_s": round(anchor_pull_s, 2),
                                  "mb": round(anchor_bytes / 1e6, 1),
                                  "refresh_s": round(anchor_publish_s + anchor_pull_s, 2)}
        print(f"  full checkpoint: {out['full_checkpoint']}", file=sys.stderr, flush=True)
        announcements.wait(0)

        # v1: the delta path
        t0 = time.perf_counter()
        publisher.publish(v1, 1, owned=True)  # as the trainer does: a backend's state_dict is its own copy
        blocked_s = time.perf_counter() - t0
        publisher.flush()
        publish_s = time.perf_counter() - t0
        announced_ms = announcements.wait(1)
        t_apply = time.perf_counter()
        version, delta_bytes = subscriber.apply_to(serving, 1)
        synchronize(device)
        apply_s = time.perf_counter() - t_apply
        announce_to_serving_s = time.time() - announced_ms / 1000.0
        exact = all(same_bits(serving[k], v1[k]) for k in v1)
        manifest = subscriber.store.manifest(1)
        out["delta"] = {
            "trainer_blocked_s": round(blocked_s, 3),
            "publish_s": round(publish_s, 2),
            "mb": round(delta_bytes / 1e6, 1),
            "share_of_full": round(delta_bytes / (params * 2), 4),
            "sparsity": manifest.sparsity,
            "apply_in_place_s": round(apply_s, 2),
            "announce_to_serving_s": round(announce_to_serving_s, 2),
            "engine_paused_s": round(apply_s, 2),
            "bit_exact": exact,
            "version": version,
        }
        out["speedup_vs_full_checkpoint"] = round(out["full_checkpoint"]["refresh_s"]
                                                  / (publish_s + apply_s), 1)
        print(f"  delta: {out['delta']}", file=sys.stderr, flush=True)

        # v2: the engine-side patch path (decode off to the side, pause only to write the changed
        # entries, verify after), against v1's in-place apply above.
        del v0
        v2 = sparse_update(v1, changed, seed=2)
        publisher.publish(v2, 2, owned=True)
        del v1
        publisher.flush()
        announced_ms = announcements.wait(2)
        t0 = time.perf_counter()
        patch = subscriber.prepare_patch(serving, 2)
        prepare_s = time.perf_counter() - t0
        synchronize(device)
        t0 = time.perf_counter()
        patch.write(serving)  # an engine runs this between two decoding steps (HFEngine.update_weights with an InPlacePatch)
        synchronize(device)
        paused_s = time.perf_counter() - t0
        announce_to_serving_s = time.time() - announced_ms / 1000.0
        subscriber.patched(patch)
        t0 = time.perf_counter()
        mismatched = patch.verify(serving)
        verify_s = time.perf_counter() - t0
        floor_s = touch_floor_s(serving, patch.changes, torch.get_num_threads()) if device.type == "cpu" else None
        decoded_mb = sum(c.nbytes for c in patch.changes) / 1e6
        out["patch"] = {
            "prepare_s": round(prepare_s, 3),
            "engine_paused_s": round(paused_s, 3),
            "cache_line_floor_s": None if floor_s is None else round(floor_s, 3),
            "announce_to_serving_s": round(announce_to_serving_s, 2),
            "verify_after_s": round(verify_s, 2),
            "subscriber_extra_mb": round(decoded_mb + patch.bytes / 1e6, 1),
            "largest_tensor_mb": round(max(t.numel() * t.element_size() for t in serving.values()) / 1e6, 1),
            "bit_exact": not mismatched and all(same_bits(serving[k], v2[k]) for k in v2),
        }
        out["patch"]["paused_vs_apply_in_place"] = round(paused_s / max(apply_s, 1e-9), 3)
        print(f"  patch: {out['patch']}", file=sys.stderr, flush=True)
    finally:
        announcements.close()
        subscriber.close()
        publisher.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--changed", type=float, default=0.01, help="share of entries changed per version (0.01)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="torch device of the serving tensors (cpu, cuda)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    torch.set_num_threads(args.threads)

    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack

    result: dict = {"benchmark": "weight_refresh", "changed": args.changed, "threads": args.threads,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory(prefix="af-refresh-") as tmp:
        stack, _ = EmbeddedStack.start_private(Path(tmp) / "stack")
        try:
            cfg = ClusterConfig(state_dir=Path(tmp) / "stack").resolve()
            for name in [m.strip() for m in args.models.split(",") if m.strip()]:
                if name not in SHAPES:
                    ap.error(f"unknown model {name!r}; choose from {sorted(SHAPES)}")
                result[name] = bench_model(cfg, name, args.changed, device)
        finally:
            stack.down()
    last = result[[m for m in SHAPES if m in result][-1]]
    result["announce_to_serving_s"] = last["patch"]["announce_to_serving_s"]
    result["engine_paused_s"] = last["patch"]["engine_paused_s"]
    result["cache_line_floor_s"] = last["patch"]["cache_line_floor_s"]
    result["baseline_apply_in_place"] = {k: last["delta"][k] for k in ("announce_to_serving_s", "engine_paused_s")}
    result["speedup_vs_full_checkpoint"] = last["speedup_vs_full_checkpoint"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
