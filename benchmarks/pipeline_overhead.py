"""Pipeline overhead: the demo's math recipe in one process and as the distributed system, one run.

* **one process** (``scripts/rl_inprocess.py``'s loop: no broker, no bucket): SFT warm start, then
  ``--steps`` RL steps; s/step = RL seconds / steps.
* **distributed** (``astraflow run``'s code path on a private embedded stack, every component its own
  process), once per ``--fetch-wait-ms`` value (``kafka.fetch_max_wait_ms`` of every consumer): steady
  state s/step after ``--warmup`` steps, trainer busy fraction (step / (wait + step + publish)), node
  busy fraction (share of the window a node runs an episode), and the latency of each hand-off from
  the record timestamps the components report (``handoff_ms`` in their metrics records,
  astraflow.log.handoff):

  - ``task_to_node``: task record sent by the dataflow -> polled by a node;
  - ``trajectory_to_dataflow``: trajectory record sent by a node -> polled by the dataflow;
  - ``batch_to_trainer``: batch record sent by the dataflow -> the trainer starts its step on it
    (includes the time the batch queued while the trainer was busy);
  - ``announcement_to_serving``: weight announcement sent by the trainer -> the node serves it (pull,
    decode and load included);
  - ``step_to_announcement``: the trainer's step ends -> its version's announcement is acknowledged
    (the publisher's copy, delta encode, uploads and manifest; ``publish_s`` of the step records).

CPU: the seconds each role (trainer, raas node, dataflow, archive, tansu, seaweedfs) used per steady
step, read from ``/proc``; their sum divided by the cores gives ``cpu_bound_s_per_step``, the least
s/step that much work allows here however well it overlaps (``cpu_bound_ratio`` against the one-process
s/step). The one-process loop's CPU per step (all its threads) is given beside it.

Prints one JSON line last: every figure, and ``ratio_to_one_process`` (distributed s/step / one-process
s/step) per setting.

    nice -n 10 python benchmarks/pipeline_overhead.py [--steps 40] [--fetch-wait-ms 500,20] [--log-storage memory]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from _cpu import ProcessCpu
from _harness import ROOT, episode_spans, quantiles, summarize

from astraflow.records.control import ControlRecord, DataflowCounters, NodeStatus, TrainerStep
from astraflow.testing.runs import load_recipe, run_recipe

RECIPE = ROOT / "examples" / "recipes" / "math.yaml"
HANDOFFS = ("task_to_node", "trajectory_to_dataflow", "batch_to_trainer", "announcement_to_serving",
            "step_to_announcement")


def one_process(steps: int, seed: int) -> dict:
    """The recipe's SFT + RL loop in this process (the baseline)."""
    import rl_inprocess
    import torch

    torch.set_num_threads(2)
    res = rl_inprocess.run_recipe(str(RECIPE), {"trainer.steps": steps}, seed, quiet=True)
    return {"s_per_step": round(res["rl_seconds"] / steps, 4), "rl_seconds": res["rl_seconds"],
            "cpu_s_per_step": round(res["rl_cpu_seconds"] / steps, 4), "steps": steps, "wall_s": res["wall_seconds"]}


def handoff_name(topic: str, run: str) -> str | None:
    """Which hand-off a ``handoff_ms`` key of a metrics record measures."""
    if topic.startswith(f"{run}.tasks."):
        return "task_to_node"
    if topic == f"{run}.trajectories":
        return "trajectory_to_dataflow"
    if topic.startswith(f"{run}.batches."):
        return "batch_to_trainer"
    if topic.startswith(f"{run}.weights.") and topic.endswith(":serving"):
        return "announcement_to_serving"
    return None


def handoff_figures(metrics: list[ControlRecord], run: str, since: float) -> dict[str, dict]:
    """p50 / p99 per hand-off over the records written after ``since`` (the steady state)."""
    samples: dict[str, list[float]] = {name: [] for name in HANDOFFS}
    for rec in metrics:
        if not isinstance(rec, (TrainerStep, NodeStatus, DataflowCounters)) or rec.time < since:
            continue  # the records that carry hand-off figures
        for topic, figures in rec.handoff_ms.items():
            name = handoff_name(topic, run)
            if name is not None:
                samples[name] += figures.get("samples", [])
        if isinstance(rec, TrainerStep) and rec.publish_s is not None:
            samples["step_to_announcement"].append(round(rec.publish_s * 1000, 1))
    return {name: {**quantiles(xs), "n": len(xs)} if xs else {"n": 0} for name, xs in samples.items()}


def distributed(cfg, fetch_wait_ms: int, steps: int, warmup: int, runs_dir: Path, timeout_s: float,
                threads: int | None = None) -> dict:
    from astraflow.launcher.plan import available_cores, threads_per_component

    recipe = load_recipe(RECIPE, trainer={"steps": steps})
    threads = threads or threads_per_component(recipe)
    run_cfg = cfg.model_copy(update={"kafka": cfg.kafka.model_copy(update={"fetch_max_wait_ms": fetch_wait_ms})})
    with ProcessCpu() as cpu:
        rec = run_recipe(recipe, run_cfg, runs_dir=runs_dir, label=f"overhead-{fetch_wait_ms}", timeout_s=timeout_s,
                         threads=threads)
    figures = summarize(rec, warmup_steps=warmup)
    policy = figures["policies"][recipe.policies[0].name]
    trainer_steps = sorted((r for r in rec.metrics if isinstance(r, TrainerStep)), key=lambda r: r.step)
    since = trainer_steps[warmup].time if len(trainer_steps) > warmup else 0.0
    spans = episode_spans(rec.trajectories)
    measured = len(trainer_steps) - 1 - warmup
    cpu_s = cpu.between(since, trainer_steps[-1].time) if measured > 0 else {}
    cpu_per_step = {role: round(s / measured, 4) for role, s in sorted(cpu_s.items(), key=lambda kv: -kv[1])}
    total = sum(cpu_s.values()) / measured if cpu_s else None
    return {
        "fetch_max_wait_ms": fetch_wait_ms,
        "threads": threads,
        "s_per_step": figures["iteration_s"],
        "s_per_step_p50": policy["iteration_s_p50"],
        "trainer_busy_fraction": round(1.0 - figures["trainer_idle_fraction"], 3),
        "node_busy_fraction": (round(1.0 - figures["rollout_idle_fraction"], 3)
                               if figures["rollout_idle_fraction"] is not None else None),
        "step_s_mean": policy["step_s_mean"],
        "handoff_ms": handoff_figures(rec.metrics, rec.run_id, since),
        "cpu_s_per_step": cpu_per_step,
        "cpu_s_per_step_total": round(total, 4) if total else None,
        # the least s/step that much CPU allows on this machine's cores, however well it overlapped
        "cores": available_cores(),
        "cpu_bound_s_per_step": round(total / available_cores(), 4) if total else None,
        "trajectories_produced": figures["trajectories_produced"],
        "trajectories_dropped": figures["trajectories_dropped"],
        "nodes": len(spans),
        "wall_s": figures["wall_s"],
        "ok": figures["ok"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="RL steps of each run (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="distributed steps left out of the measurement")
    ap.add_argument("--fetch-wait-ms", default="500,20",
                    help="comma-separated kafka.fetch_max_wait_ms values, one distributed run each "
                         "(default 500 = kafka-python's default, and 20)")
    ap.add_argument("--log-storage", choices=["memory", "s3"], default="memory",
                    help="the embedded broker's log storage (default memory; s3 is the durable default of runs)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per component (default: astraflow run's, the cores divided among the "
                    "trainer and the node: 1 on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per distributed run")
    args = ap.parse_args(argv)
    waits = [int(x) for x in args.fetch_wait_ms.split(",") if x.strip()]

    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack

    t0 = time.monotonic()
    result: dict = {"benchmark": "pipeline_overhead", "recipe": str(RECIPE.relative_to(ROOT)), "steps": args.steps,
                    "log_storage": args.log_storage}
    print("one process ...", file=sys.stderr, flush=True)
    result["one_process"] = one_process(args.steps, args.seed)
    print(f"  {result['one_process']['s_per_step']:.3f} s/step", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="af-overhead-") as tmp:
        state_dir = Path(tmp) / "stack"
        stack, _ = EmbeddedStack.start_private(state_dir, storage=args.log_storage)
        try:
            cfg = ClusterConfig(state_dir=state_dir).resolve()
            result["distributed"] = []
            for wait in waits:
                print(f"distributed, fetch_max_wait_ms={wait} ...", file=sys.stderr, flush=True)
                d = distributed(cfg, wait, args.steps, args.warmup, Path(tmp) / "runs", args.timeout, args.threads)
                d["ratio_to_one_process"] = round(d["s_per_step"] / result["one_process"]["s_per_step"], 2)
                if d["cpu_bound_s_per_step"]:
                    d["cpu_bound_ratio"] = round(d["cpu_bound_s_per_step"] / result["one_process"]["s_per_step"], 2)
                result["distributed"].append(d)
                p50s = {k: v.get("p50") for k, v in d["handoff_ms"].items()}
                print(f"  {d['s_per_step']:.3f} s/step ({d['ratio_to_one_process']}x), trainer busy "
                      f"{d['trainer_busy_fraction']:.0%}, node busy {d['node_busy_fraction']}, hand-off p50 ms {p50s}",
                      file=sys.stderr, flush=True)
                if d["cpu_bound_s_per_step"]:
                    print(f"  CPU per step {d['cpu_s_per_step_total']:.3f} s {d['cpu_s_per_step']} (one process "
                          f"{result['one_process']['cpu_s_per_step']:.3f}): on {d['cores']} cores at least "
                          f"{d['cpu_bound_s_per_step']:.3f} s/step = {d['cpu_bound_ratio']}x", file=sys.stderr, flush=True)
        finally:
            stack.down()
    best = min(result["distributed"], key=lambda d: d["s_per_step"])
    result["best_fetch_max_wait_ms"] = best["fetch_max_wait_ms"]
    result["ratio_to_one_process"] = best["ratio_to_one_process"]
    result["handoff_p50_ms"] = {k: v.get("p50") for k, v in best["handoff_ms"].items()}
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))
    return 0 if all(d["ok"] for d in result["distributed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
