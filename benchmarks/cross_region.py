"""Two regions on one machine: pools in each, the remote one behind a shaped link, with and without
a regional replica of the bucket.

Region A holds the run: the Kafka broker (Tansu) and the origin bucket (SeaweedFS), the dataflow,
the trainer and the ``fast`` pool (simulated engine at 100% speed), all started by the launcher.
Region B holds the ``mid`` (60%) and ``slow`` (30%) pools, one node each, started by hand like
nodes joining from elsewhere, with a cluster config of their own. Every TCP connection from region B
to region A crosses a simulated WAN (benchmarks/_wan.py: delaying, pacing relays; default 150 ms
each way = 300 ms RTT, 20 Mbit/s per direction, the paper's 4 Gbit/s scaled down with the weights).

Two runs, same recipe:
* ``origin``: region B reads weights from the origin bucket, across the link;
* ``replica``: region B has a second SeaweedFS, fed by ``weed filer.sync`` (SeaweedFS's own
  replication, run in region B, reading region A's filer across the link), and its nodes name it in
  ``region:`` (``on_missing: wait``); Kafka stays shared, across the link.

Token generation and gradient steps are SIMULATED (examples/recipes/sim_hetero.yaml, with a larger
published tensor so that weights are a visible share of the link). Reported per run: each pool's
trajectories in every trained batch (and whether every pool contributed to every iteration), trainer
idle, weight refresh lag per region (announcement -> the node serves it; the node's pull + load
time; the replication lag region B's reader waited out), and the bytes that crossed the link per
endpoint. Prints a human summary on stderr and ONE JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml
from _harness import ROOT, quantiles, summarize
from _wan import SITE_DIR, WanLink

from astraflow.records.control import ControlRecord, NodeStatus
from astraflow.testing.runs import private_cluster, run_recipe, trainer_steps

RECIPE = ROOT / "examples" / "recipes" / "sim_hetero.yaml"
REGION_A_POOLS = ("fast",)
REGION_B_POOLS = ("mid", "slow")


def build_recipe(steps: int, params: int, step_base_s: float):
    """sim_hetero with ``params`` published entries, one anchor (v0), a longer step (so that an
    iteration is long against the link's round trips, as a real model's is), region B's pools left
    to us."""
    from astraflow.recipe import Recipe

    data = yaml.safe_load(RECIPE.read_text())
    data["trainer"].update({"steps": steps, "anchor_every": 1000})
    data["policies"][0]["backend"].update({"params": params, "step_base_s": step_base_s})
    for pool in data["pools"]:
        pool["nodes"] = 1 if pool["name"] in REGION_A_POOLS else 0  # B's nodes are started by hand
    recipe = Recipe.model_validate(data)
    recipe.source = RECIPE.resolve()
    return recipe


def start_region_b(recipe, cfg, run_id: str, workdir: Path, redirect: dict[str, str],
                   region: dict | None) -> list[subprocess.Popen]:
    """Region B's nodes (``astraflow raas``), routed through the link, reading ``region``'s replica
    if given. Their cluster config names region A's real addresses: the link is the network's job."""
    from astraflow.launcher.plan import effective_recipe, write_recipe

    workdir.mkdir(parents=True, exist_ok=True)
    recipe_file = write_recipe(effective_recipe(recipe, run_id=run_id), workdir / "recipe.yaml")
    cluster = json.loads(cfg.model_copy(update={"run": run_id}).model_dump_json(exclude_none=True))
    if region:
        cluster["region"] = region
    cluster_file = workdir / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(cluster))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env.update({"PYTHONPATH": str(SITE_DIR), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "ASTRAFLOW_TORCH_THREADS": "1",
                "ASTRAFLOW_BENCH_REDIRECT": ",".join(f"{a}={b}" for a, b in redirect.items())})
    procs = []
    for pool in REGION_B_POOLS:
        node = f"raas-{pool}-0"
        with open(workdir / f"{node}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "astraflow.cli.main", "--config", str(cluster_file), "raas",
                 "--recipe", str(recipe_file), "--pool", pool, "--node-id", node],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True))
    return procs


def stop_all(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


class ReplicaProbe:
    """When each published version's manifest first appeared in the replica (a LIST every 50 ms, in
    region B: no link crossed): minus its announcement time, the replication lag of that version."""

    def __init__(self, endpoint: str, cfg, run_id: str, policy: str = "policy") -> None:
        from astraflow.objstore import ObjectStore, RunLayout, parse_version

        s3 = cfg.s3.model_copy(update={"endpoint": endpoint})
        self.store = ObjectStore.from_config(cfg.model_copy(update={"s3": s3}))
        self.prefix = RunLayout(run_id).weights_prefix(policy)
        self._parse = parse_version
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                keys = list(self.store.list(self.prefix))
            except Exception:  # noqa: BLE001 - the replica is busy: look again
                keys = []
            now = time.time()
            for key in keys:
                if key.endswith("/manifest.json"):
                    self.seen.setdefault(self._parse(key), now)

    def lags_s(self, announced: list[tuple[int, float]]) -> list[float]:
        self._stop.set()
        self._thread.join(5)
        return [max(0.0, self.seen[v] - ts) for v, ts in announced if v in self.seen and ts]


def refresh_by_region(metrics: list[ControlRecord], run_id: str, node_region: dict[str, str]) -> dict[str, Any]:
    """Per region: announcement -> serving (ms, merged samples of the nodes' records), the nodes'
    pull + load seconds, and the replica reader's figures (region B with a replica)."""
    topic = f"{run_id}.weights.policy:serving"
    serving: dict[str, list[float]] = defaultdict(list)
    refresh: dict[str, list[float]] = defaultdict(list)
    reader: dict[str, dict] = {}
    lags: dict[str, list[float]] = defaultdict(list)
    for r in metrics:
        if not isinstance(r, NodeStatus) or r.node_id not in node_region:
            continue
        region = node_region[r.node_id]
        if topic in r.handoff_ms:
            serving[region] += r.handoff_ms[topic].get("samples", [])
        if r.refresh_s:
            refresh[region].append(r.refresh_s)
        if r.region:
            reader[r.node_id] = r.region  # cumulative: the last record wins
            if r.region.get("lag_s") is not None:
                lags[region].append(float(r.region["lag_s"]))
    out = {}
    for region in sorted(set(node_region.values())):
        nodes = [n for n, reg in node_region.items() if reg == region and n in reader]
        out[region] = {
            "announce_to_serving_ms": quantiles(serving[region]),
            "pull_and_load_s": quantiles(refresh[region]),
            "replication_lag_waited_s": quantiles(lags[region]),
            "replica_reader": {n: {k: reader[n][k] for k in ("replica_bytes", "origin_bytes", "misses",
                                                             "fallbacks", "timeouts", "lag_max_s")}
                               for n in nodes},
        }
    return out


def one_run(label: str, recipe, cfg, tmp: Path, link: WanLink, relays: dict[str, int],
            args: argparse.Namespace, replica=None) -> dict[str, Any]:
    from astraflow.embedded.replica import FilerSync, filer_address

    run_id = f"xregion-{label}-{uuid.uuid4().hex[:6]}"
    a_kafka, a_s3 = cfg.kafka.bootstrap, cfg.s3.endpoint.removeprefix("http://")
    redirect = {a_kafka: f"127.0.0.1:{relays['kafka']}", a_s3: f"127.0.0.1:{relays['s3']}"}
    region = None
    sync = probe = None
    if replica is not None:
        region = {"name": "b", "s3_endpoint": replica.endpoint, "on_missing": "wait", "max_wait_s": 60}
        # Region B replicates this run's weights and claims (not trainer state, not the archive),
        # reading region A's filer through the link.
        sync = FilerSync(tmp / f"sync-{label}", filer_address("127.0.0.1", relays["filer_http"], relays["filer_grpc"]),
                         replica.filer, prefix=run_id, exclude=("trainer", "archive", "dataflow"),
                         source_proxy=True)
        sync.start()
        probe = ReplicaProbe(replica.endpoint, cfg, run_id)
    before = link.counters()
    node_pool = {f"raas-{p.name}-0": p.name for p in recipe.pools}
    node_region = {n: ("a" if p in REGION_A_POOLS else "b") for n, p in node_pool.items()}
    procs = start_region_b(recipe, cfg, run_id, tmp / f"region-b-{label}", redirect, region)
    try:
        rec = run_recipe(recipe, cfg, runs_dir=tmp / "runs", label=label, timeout_s=args.timeout, run_id=run_id)
    finally:
        stop_all(procs)
        if sync is not None:
            sync.stop()
    after = link.counters()
    crossed = {name: {d: after[name][d] - before.get(name, {}).get(d, 0) for d in after[name]} for name in after}
    s = summarize(rec, warmup_steps=args.warmup, node_pool=node_pool)
    steps = trainer_steps(rec.metrics, "policy")[args.warmup:]
    pools = s["pools"]
    weights_bytes = sum(v["a_to_b"] + v["b_to_a"] for k, v in crossed.items() if k != "kafka")
    return {
        "run": run_id,
        "ok": s["ok"],
        "every_pool_every_iteration": all(pools[p]["min_per_iteration"] > 0 for p in pools),
        "pools": {p: {"region": "a" if p in REGION_A_POOLS else "b", **v} for p, v in pools.items()},
        "trainer_idle_per_iteration": [round(x.wait_s / max(1e-9, x.wait_s + x.step_s), 3) for x in steps],
        "trainer_idle_fraction": s["trainer_idle_fraction"],
        "iteration_s": s["iteration_s"],
        "staleness_hist": s["staleness_hist"],
        "trajectories_produced_by_pool": dict(Counter(node_pool.get(t.node_id, "?") for t in rec.trajectories)),
        "trajectories_dropped": s["trajectories_dropped"],
        "refresh_by_region": refresh_by_region(rec.metrics, run_id, node_region),
        "replication_lag_s": quantiles(probe.lags_s(rec.announced.get("policy", []))) if probe else None,
        "link_bytes": crossed,
        "link_bytes_total": sum(v["a_to_b"] + v["b_to_a"] for v in crossed.values()),
        "link_bytes_object_store": weights_bytes,
        "wall_s": round(rec.wall_s, 1),
    }


def report(label: str, r: dict) -> None:
    print(f"[{label}] ok={r['ok']} every pool every iteration={r['every_pool_every_iteration']} "
          f"iteration {r['iteration_s']:.2f} s, trainer idle {r['trainer_idle_fraction']:.0%}; produced "
          f"{r['trajectories_produced_by_pool']}, dropped {r['trajectories_dropped']}", file=sys.stderr)
    for p, v in r["pools"].items():
        print(f"  pool {p:5s} region {v['region']}: trajectories/iteration {v['trajectories_per_iteration']} "
              f"(share {v['share']:.0%})", file=sys.stderr)
    for region, v in r["refresh_by_region"].items():
        print(f"  region {region}: announce->serving ms {v['announce_to_serving_ms']}, pull+load s "
              f"{v['pull_and_load_s']}, replication lag waited s {v['replication_lag_waited_s']}", file=sys.stderr)
    if r["replication_lag_s"]:
        print(f"  replication lag (announcement -> manifest in the replica) s {r['replication_lag_s']}",
              file=sys.stderr)
    print(f"  link bytes {r['link_bytes']} (object store {r['link_bytes_object_store'] / 1e6:.1f} MB, "
          f"total {r['link_bytes_total'] / 1e6:.1f} MB)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16, help="trainer steps per run (default 16)")
    ap.add_argument("--warmup", type=int, default=8,
                    help="steps left out of the measurement (default 8: region B's first anchor pull over the "
                         "link, and the first tasks' backlog, which the slow pool drains for several steps)")
    ap.add_argument("--step-s", type=float, default=4.0,
                    help="simulated step base seconds (default 4: an iteration long against the link's "
                         "round trips, as a real model's is)")
    ap.add_argument("--rtt-ms", type=float, default=300.0, help="round-trip time of the link (default 300)")
    ap.add_argument("--mbit", type=float, default=20.0, help="link bandwidth per direction, Mbit/s (default 20)")
    ap.add_argument("--params", type=int, default=4_000_000,
                    help="published bf16 entries (default 4M: an 8 MB anchor, ~1%% changed per step)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per run")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the stack, logs and runs here (default: a "
                    "temporary directory, removed)")
    args = ap.parse_args(argv)

    from astraflow.embedded.replica import SeaweedServer

    t0 = time.monotonic()
    recipe = build_recipe(args.steps, args.params, args.step_s)
    speeds = {p.name: p.engine.speed for p in recipe.pools}
    results = {}
    with contextlib.ExitStack() as cleanup:
        tmp = args.workdir or Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="af-xregion-")))
        with private_cluster(tmp / "stack") as cfg:
            stack = json.loads((tmp / "stack" / "stack.json").read_text())
            link = WanLink(delay_s=args.rtt_ms / 2000.0, mbit_s=args.mbit)
            host, port = cfg.kafka.bootstrap.rsplit(":", 1)
            ports = stack["ports"]
            relays = {  # every region-A endpoint region B talks to
                "kafka": link.relay("kafka", host, int(port)),
                "s3": link.relay("s3", "127.0.0.1", ports["s3"]),
                "filer_http": link.relay("filer_http", "127.0.0.1", ports["filer"]),
                "filer_grpc": link.relay("filer_grpc", "127.0.0.1", ports["filer_grpc"]),
            }
            replica = SeaweedServer(tmp / "replica", cfg.s3.access_key, cfg.s3.secret_key, name="seaweedfs-b")
            replica.start()
            try:
                results["origin"] = one_run("origin", recipe, cfg, tmp, link, relays, args)
                report("without replica", results["origin"])
                results["replica"] = one_run("replica", recipe, cfg, tmp, link, relays, args, replica)
                report("with replica", results["replica"])
            finally:
                replica.stop()
                link.close()
    o, r = results["origin"]["link_bytes_object_store"], results["replica"]["link_bytes_object_store"]
    print(f"object-store bytes across the link: {o / 1e6:.1f} MB without the replica, {r / 1e6:.1f} MB with it",
          file=sys.stderr)
    result = {
        "benchmark": "cross_region",
        "link": {"rtt_ms": args.rtt_ms, "mbit_s": args.mbit},
        "speeds": speeds,
        "regions": {"a": list(REGION_A_POOLS), "b": list(REGION_B_POOLS)},
        "published_params": args.params,
        "without_replica": results["origin"],
        "with_replica": results["replica"],
        "object_store_bytes_ratio": round(r / o, 3) if o else None,
        "every_pool_every_iteration": all(v["every_pool_every_iteration"] for v in results.values()),
        "ok": all(v["ok"] for v in results.values()),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
