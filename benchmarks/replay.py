"""Replay rate: ``astraflow replay``'s code over a synthetic archive of N trajectories in the real S3.

Writes ``--trajectories`` synthetic trajectories (groups of ``--group-size``, one log record per group,
tokens at the version announced ``--lag`` versions earlier, 0/1 rewards) as archive parts of
``--part-rows`` rows plus a weight timeline (one announcement per batch) into a private embedded
SeaweedFS, then replays them with the recipe-like configuration (FIFO, max_staleness 1) and with a
DAPO filter, through :class:`astraflow.archive.replay.ArchivedRun` — the same reader and ``Dataflow``
the command uses. Reports trajectories/s of each replay, the bytes archived, and the peak memory
the replay allocated (``tracemalloc``, in a second, traced pass) over a quarter of the run and over all
of it: streaming by row group keeps them close (what grows is the dataflow's dedup memory, capped at
``dedup_capacity`` episode ids). Baselines in the same run, without the dataflow: reading the same parts and
decoding them as the replay does (lazy Trajectory objects grouped into log records: its floor), and
decoding every field eagerly (``trajectory.from_table``, as the online dataflow does).

    nice -n 10 python benchmarks/replay.py [--trajectories 1000000]

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa


def synthetic_parts(n: int, group_size: int, part_rows: int, groups_per_batch: int, lag: int, seed: int):
    """(kind, policy, first_offset, table) of the synthetic archive, in log order."""
    from astraflow.archive import rows as R
    from astraflow.records import episode_id_for, group_id_for

    rng = random.Random(seed)
    groups = n // group_size
    cols: dict[str, list] = {f.name: [] for f in R.TRAJECTORY_SCHEMA}
    weights = []
    first = 0
    for g in range(groups):
        version = max(0, g // groups_per_batch - lag)
        if g % groups_per_batch == 0:
            weights.append({"policy": "policy", "version": g // groups_per_batch, "kind": "delta", "manifest": None,
                            "bytes": None, "checksum": None, "log_partition": 0, "log_offset": len(weights),
                            "log_timestamp_ms": 1_000 + 10 * g - 1})
        task = f"t{g}"
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        for i in range(group_size):
            row = {"episode_id": episode_id_for(task, "policy", i), "task_id": task,
                   "group_id": group_id_for(task, "policy"), "sample_index": i, "policy": "policy",
                   "prompt_ids": [1, 2, 3, 4], "response_ids": [5, 6, 7], "logprobs": [-0.5, -0.4, -0.3],
                   "versions": [version] * 3, "loss_mask": [1, 1, 1], "reward": rewards[i],
                   "rewards": [("correct", rewards[i])], "turn_bounds": [0], "node_id": "n0", "created_at": 0.0,
                   "gen_seconds": 0.1, "task_type": "math", "log_partition": 0, "log_offset": g,
                   "log_timestamp_ms": 1_000 + 10 * g}
            for k, v in row.items():
                cols[k].append(v)
        if len(cols["episode_id"]) >= part_rows or g == groups - 1:
            yield R.TRAJECTORIES, "policy", first, pa.table(cols, schema=R.TRAJECTORY_SCHEMA)
            first = g + 1
            cols = {f.name: [] for f in R.TRAJECTORY_SCHEMA}
    yield R.WEIGHTS, "policy", 0, pa.Table.from_pylist(weights, schema=R.WEIGHTS_SCHEMA)


def write_archive(store, run: str, parts) -> tuple[int, int]:
    from astraflow.archive import rows as R
    from astraflow.objstore import RunLayout

    lay, n_bytes, n_parts = RunLayout(run), 0, 0
    for kind, policy, first, table in parts:
        data = R.to_parquet(kind, [table], topic=f"{run}.{kind}", partition=0, first_offset=first,
                            last_offset=first + table.num_rows - 1)
        store.put_bytes(lay.archive_part_key(kind, policy, f"{run}.{kind}", 0, first), data)
        n_bytes += len(data)
        n_parts += 1
    return n_bytes, n_parts


def measured(fn):
    """(result, seconds, peak bytes allocated through Python while it ran)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, seconds, peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=200_000, help="synthetic trajectories (default 200k)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-batch", type=int, default=16)
    ap.add_argument("--part-rows", type=int, default=50_000, help="rows per archive part (default 50k)")
    ap.add_argument("--lag", type=int, default=1, help="versions the tokens lag the announced version")
    args = ap.parse_args(argv)

    from astraflow.archive.replay import ArchivedRun, read_row_groups, replay, trajectory_events
    from astraflow.archive.replay import archive_parts as parts_of
    from astraflow.config import ClusterConfig
    from astraflow.dataflow.config import DataflowConfig
    from astraflow.embedded import EmbeddedStack
    from astraflow.objstore import ObjectStore
    from astraflow.records import trajectory

    result: dict = {"benchmark": "replay", "trajectories": args.trajectories}
    with tempfile.TemporaryDirectory(prefix="af-replay-") as tmp:
        stack, _ = EmbeddedStack.start_private(Path(tmp) / "stack")
        try:
            cfg = ClusterConfig(state_dir=Path(tmp) / "stack").resolve()
            store = ObjectStore.from_config(cfg)
            run = "replay-bench"
            t0 = time.perf_counter()
            n_bytes, n_parts = write_archive(store, run, synthetic_parts(
                args.trajectories, args.group_size, args.part_rows, args.groups_per_batch, args.lag, 0))
            result["archive"] = {"mb": round(n_bytes / 1e6, 1), "parts": n_parts,
                                 "write_s": round(time.perf_counter() - t0, 1)}
            print(f"archive: {result['archive']}", file=sys.stderr, flush=True)

            keys = [k for stream in parts_of(store, run, "trajectories") for k in stream]

            def decode_only() -> int:  # what a replay decodes: lazy trajectories grouped into records
                return sum(len(e.trajectories) for e in trajectory_events(read_row_groups(store, keys)))

            def decode_eager() -> int:  # every field as Python objects (what the online dataflow decodes)
                return sum(len(trajectory.from_table(t)) for t in read_row_groups(store, keys))

            for label, fn in (("baseline_decode_only", decode_only), ("decode_eager", decode_eager)):
                t0, c0 = time.perf_counter(), time.process_time()
                n = fn()
                result[label] = {"trajectories_per_s": round(n / (time.perf_counter() - t0)),
                                 "cpu_s": round(time.process_time() - c0, 2)}
                print(f"{label}: {result[label]}", file=sys.stderr, flush=True)
            base = DataflowConfig(policies=["policy"], groups_per_batch=args.groups_per_batch, max_staleness=1)
            configs = {"fifo": base, "dapo": base.model_copy(update={"filters": [{"type": "dynamic_sampling"}]})}
            for name, section in configs.items():
                t0, c0 = time.perf_counter(), time.process_time()
                summary = replay(name, section, ArchivedRun(store, run).events(), args.group_size).summary()
                secs = time.perf_counter() - t0
                # cpu_s: this process's CPU time (both threads), less sensitive than the wall time to
                # other load on the machine.
                result[name] = {"trajectories_per_s": round(summary["received"] / secs), "seconds": round(secs, 1),
                                "cpu_s": round(time.process_time() - c0, 2),
                                "received": summary["received"], "kept": summary["kept"],
                                "stale": summary["dropped"]["stale"], "batches": summary["batches"]}
                print(f"{name}: {result[name]}", file=sys.stderr, flush=True)
            # Memory (a second pass, traced: tracemalloc slows Python several times): the peak over a
            # quarter of the run and over all of it; bounded streaming keeps them close.
            groups = args.trajectories // args.group_size
            result["peak_mb"] = {}
            for label, until in (("quarter", {0: groups // 4}), ("whole", None)):
                run_events = ArchivedRun(store, run, until=until).events()
                _, _, peak = measured(lambda ev=run_events: replay("fifo", base, ev, args.group_size))
                result["peak_mb"][label] = round(peak / 1e6, 1)
            print(f"peak MB: {result['peak_mb']}", file=sys.stderr, flush=True)
        finally:
            stack.down()
    result["trajectories_per_s"] = result["fifo"]["trajectories_per_s"]
    result["ratio_to_decode_only"] = round(result["fifo"]["trajectories_per_s"]
                                           / result["baseline_decode_only"]["trajectories_per_s"], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
