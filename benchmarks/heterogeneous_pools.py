"""Three rollout pools at 100% / 60% / 30% relative throughput feeding one trainer, async mode.

Real broker, bucket, dataflow, trainer and three RaaS nodes as separate processes (the launcher);
token generation and gradient steps are SIMULATED (examples/recipes/sim_hetero.yaml). The dataflow
spreads tasks with ``route_pools`` (most free slots first). Reported, per pool: trajectories in each
trained batch (every pool must contribute to every iteration), its share, the weight-refresh time
(``refresh_s`` of its node: pull + decode + load of a new version) and the version lag sampled at
its metrics records; per iteration: the trainer's idle fraction (wait / (wait + step)).

Prints a human summary on stderr and ONE JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import ROOT, summarize

from astraflow.testing.runs import load_recipe, private_cluster, run_recipe, trainer_steps

RECIPE = ROOT / "examples" / "recipes" / "sim_hetero.yaml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14, help="trainer steps (default 14)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the measurement (default 3)")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    recipe = load_recipe(RECIPE, trainer={"steps": args.steps})
    node_pool = {f"raas-{p.name}-{i}": p.name for p in recipe.pools for i in range(p.nodes)}
    speeds = {p.name: p.engine.speed for p in recipe.pools}  # SimulatedEngineConfig.speed
    with tempfile.TemporaryDirectory(prefix="af-hetero-") as tmp, private_cluster(Path(tmp) / "stack") as cfg:
        rec = run_recipe(recipe, cfg, runs_dir=Path(tmp) / "runs", label="hetero", timeout_s=args.timeout)
    s = summarize(rec, warmup_steps=args.warmup, node_pool=node_pool)
    steps = trainer_steps(rec.metrics, "policy")[args.warmup:]
    idle_per_iter = [round(x.wait_s / max(1e-9, x.wait_s + x.step_s), 3) for x in steps]
    pools = s["pools"]
    every = all(pools[p]["min_per_iteration"] > 0 for p in pools)
    for p in pools:
        print(f"  pool {p:5s} speed {speeds[p]:.0%}: trajectories/iteration {pools[p]['trajectories_per_iteration']} "
              f"(share {pools[p]['share']:.0%}), refresh_s {pools[p]['refresh_s']}, "
              f"version lag {pools[p]['version_lag_at_metrics']}", file=sys.stderr)
    print(f"  trainer idle per iteration {idle_per_iter}; iteration {s['iteration_s']:.2f} s; staleness "
          f"{s['staleness_hist']}; dropped {s['trajectories_dropped']}", file=sys.stderr)
    result = {
        "benchmark": "heterogeneous_pools",
        "speeds": speeds,
        "every_pool_every_iteration": every,
        "pools": pools,
        "trainer_idle_per_iteration": idle_per_iter,
        "trainer_idle_fraction": s["trainer_idle_fraction"],
        "iteration_s": s["iteration_s"],
        "staleness_hist": s["staleness_hist"],
        "trajectories_dropped": s["trajectories_dropped"],
        "rollout_idle_by_node": s["rollout_idle_by_node"],
        "ok": s["ok"],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
