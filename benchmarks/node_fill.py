"""Does a RaaS node keep its engine full? The node's decode rate while it serves tasks, beside its
engine's own rate at the same rows, in one run.

* **engine**: ``HFEngine.generate`` of ``--rows`` prompts, each decoding exactly ``--max-new-tokens``
  tokens (no stop token): the rate the engine reaches on a full batch (median of ``--reps``).
* **node**: a real :class:`~astraflow.raas.RaasNode` (its consumer group, weight follower, outbox) on a
  private embedded stack (Tansu + SeaweedFS), never short of tasks (the task topic is filled ahead),
  ``concurrency x samples = --rows`` rows in flight, a new weight version published every
  ``--refresh-every-s`` (a real delta through the bucket, pulled and swapped in by the node). Its rate:
  the response tokens of the trajectories the node produced in a window of ``--seconds`` after a
  warm-up, over the window (read back after the node stopped: nothing else reads meanwhile), and the
  CPU the node process used in it (cores). Measured once per ``batching`` mode of the engine: ``continuous`` (rows
  join and leave the running batch each step, the default) and ``request`` (merged requests decode
  until their longest row ends: the baseline).

Responses end at different lengths, as a policy's do: the demo's tiny model (random weights; ``--model``
another spec) served
from a copy of its checkpoint whose generation config names ``--stop-ids`` end-of-turn tokens besides
eos, so every sampled token ends its row with probability ~stop-ids / vocab (lengths roughly
geometric, the longest cut at ``--max-new-tokens``; the mean and the cut fraction are reported).
One torch thread, as each component of a run has. Prints one JSON line last.

    python benchmarks/node_fill.py [--rows 64] [--samples 8] [--max-new-tokens 64] [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "models" / "tiny.yaml"


def checkpoint_with_stops(spec: str, out: Path, stop_ids: int) -> tuple[Path, list[int]]:
    """A copy of model ``spec``'s checkpoint whose generation config ends a turn at ``stop_ids`` more tokens."""
    from astraflow.models import resolve_checkpoint

    src = Path(resolve_checkpoint(spec))
    shutil.copytree(src, out)
    gen = json.loads((out / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    stops = eos + [t for t in range(100, 100 + 7 * stop_ids, 7)][:stop_ids]  # ordinary ids, spread out
    gen["eos_token_id"] = stops
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out, stops


def recipe_of(run: str, model: Path, args: argparse.Namespace, batching: str) -> dict:
    return {
        "run": run, "seed": 0,
        "dataset": {"type": "minmax", "samples": args.samples, "pool": "default"},
        "workflow": {"type": "math", "policy": "policy"},
        "policies": [{"name": "policy", "model": str(model)}],
        "pools": [{"name": "default", "concurrency": args.inflight_rows // args.samples,
                   "engine": {"type": "hf", "max_batch_size": args.rows, "batching": batching}}],
        "sampling": {"policy": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0}},
    }


def engine_rate(model_dir: Path, args: argparse.Namespace) -> float:
    """Tokens/s of ``generate`` on ``rows`` prompts x exactly ``max_new_tokens`` (median of reps)."""
    from astraflow.engines import SamplingParams, build_engine
    from astraflow.models import load_model, load_tokenizer
    from astraflow.records import Task
    from astraflow.tasks import build_dataset
    from astraflow.workflows.policy import render_messages, task_messages

    tok = load_tokenizer(model_dir)
    eng = build_engine({"type": "hf"}, load_model(model_dir))
    problems = build_dataset({"type": "minmax", "seed": 1}).problems("train", args.rows // args.samples, seed=1)
    prompts = [render_messages(tok, task_messages(Task(prompt_id=str(i), prompt=p.prompt, answer=p.answer)))
               for i, p in enumerate(problems) for _ in range(args.samples)]  # as the node's policy renders them
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=(-1,))
    eng.generate(prompts, params)  # warm-up
    rates = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        n = sum(len(g.token_ids) for g in eng.generate(prompts, params))
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def fill_tasks(cfg, n: int, samples: int) -> None:
    from astraflow.log import LogProducer, Topics, ensure_topics
    from astraflow.records import Task, task
    from astraflow.tasks import build_dataset

    topic = Topics(cfg.run).tasks("default")
    ensure_topics(cfg, {topic: 4})
    problems = build_dataset({"type": "minmax", "seed": 0}).problems("train", n, seed=0)
    with LogProducer(cfg, f"fill-{uuid.uuid4().hex[:6]}") as prod:
        for i in range(0, n, 8):  # the dataflow's way: several tasks to a record
            tasks = [Task(prompt_id=f"t{j}", prompt=p.prompt, answer=p.answer, samples=samples, pool="default")
                     for j, p in enumerate(problems[i:i + 8], start=i)]
            prod.send_table(topic, tasks[0].prompt_id, task.to_table(tasks), task.SCHEMA_NAME, task.SCHEMA_VERSION)
        prod.flush(60)


def start_node(cfg, recipe: dict, workdir: Path) -> subprocess.Popen:
    """``astraflow raas`` as its own process, one torch thread, as ``astraflow run`` starts a node."""
    cfg_path, recipe_path = workdir / f"{cfg.run}.cluster.yaml", workdir / f"{cfg.run}.recipe.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    recipe_path.write_text(yaml.safe_dump(recipe))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}  # the file is the only source
    log = open(workdir / f"{cfg.run}.node.log", "wb")  # noqa: SIM115 - the child keeps its own descriptor
    return subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "--config", str(cfg_path), "raas",
                             "--recipe", str(recipe_path), "--threads", "1", "--node-id", "bench-node"],
                            stdout=log, stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": "1"}, cwd=ROOT)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def node_rate(base_cfg, model_dir: Path, workdir: Path, args: argparse.Namespace, batching: str) -> dict:
    """The node's response tokens/s over the window (and what the window held). The trajectories are
    read back after the node stopped, so that this process's reading takes no CPU from the window."""
    from astraflow.delta.publisher import WeightPublisher
    from astraflow.log import LogConsumer, Topics
    from astraflow.log.identity import topic_partitions
    from astraflow.log.range_reader import read_to_end
    from astraflow.models import load_model
    from astraflow.records import trajectory

    cfg = base_cfg.model_copy(update={"run": f"fill-{batching}-{uuid.uuid4().hex[:6]}"})
    topic = Topics(cfg.run).trajectories
    model = load_model(model_dir)
    pub = WeightPublisher(cfg, "policy", anchor_every=10)
    pub.publish(model.state_dict(), 0)
    pub.flush()
    fill_tasks(cfg, args.tasks, args.samples)
    node = start_node(cfg, recipe_of(cfg.run, model_dir, args, batching), workdir)
    first = LogConsumer(cfg, topic, f"bench-{uuid.uuid4().hex[:6]}")
    try:
        deadline = time.monotonic() + 300
        while not first.poll(timeout_s=0.5, max_records=1):  # the node serves
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the node exited ({node.returncode}) or never served: "
                                   + (workdir / f"{cfg.run}.node.log").read_text()[-2000:])
    finally:
        first.close()
    version, cpu = 0, {}
    try:
        time.sleep(args.warmup_s)
        wall_start, t_start, cpu0 = time.time(), time.monotonic(), cpu_seconds(node.pid)
        last_publish = t_start
        while time.monotonic() < t_start + args.seconds:
            if time.monotonic() - last_publish >= args.refresh_every_s:
                with torch.no_grad():  # a small step's worth of change: a real sparse delta
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 1e-3 * (torch.rand_like(p) < 0.02))
                version += 1
                pub.publish(model.state_dict(), version)
                last_publish = time.monotonic()
            time.sleep(0.05)
            if node.poll() is not None:
                raise RuntimeError(f"the node exited ({node.returncode}): "
                                   + (workdir / f"{cfg.run}.node.log").read_text()[-2000:])
        cpu["node_cpu_cores"] = round((cpu_seconds(node.pid) - cpu0) / (time.monotonic() - t_start), 2)
        time.sleep(2.0)  # the window's last episodes reach the log
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(60)
        pub.flush()
    parts = topic_partitions(cfg, [topic])[topic]
    trajs = [t for m in read_to_end(cfg, {(topic, p): 0 for p in range(parts)}).messages if m.table is not None
             for t in trajectory.from_table(m.table)]
    window = [t for t in trajs if wall_start <= t.created_at < wall_start + args.seconds]
    lengths = [len(t.response_ids) for t in window]
    return {
        "tokens_per_s": round(sum(lengths) / args.seconds, 1),
        "trajectories": len(window),
        "mean_length": round(statistics.fmean(lengths), 1) if lengths else None,
        "cut_at_max_fraction": round(sum(n >= args.max_new_tokens for n in lengths) / len(lengths), 3) if lengths else None,
        "versions_seen": len({v for t in window for v in t.versions}),
        **cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(TINY), help="model spec YAML (default: the demo's tiny model)")
    ap.add_argument("--rows", type=int, default=64, help="the engine's batch: most rows decoded at once")
    ap.add_argument("--inflight-rows", type=int, default=128,
                    help="rows the node takes on (pool concurrency x samples); beyond --rows they wait in the engine")
    ap.add_argument("--samples", type=int, default=8, help="samples per task (a GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--stop-ids", type=int, default=24, help="end-of-turn ids besides eos (sets the mean length)")
    ap.add_argument("--seconds", type=float, default=30.0, help="measurement window of each node run")
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--refresh-every-s", type=float, default=3.0, help="a new weight version this often")
    ap.add_argument("--tasks", type=int, default=4000, help="tasks put on the topic ahead of each node run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="continuous,request")
    args = ap.parse_args()
    if args.rows % args.samples or args.inflight_rows % args.samples:
        ap.error("--rows and --inflight-rows must be multiples of --samples")
    torch.set_num_threads(1)
    from astraflow.testing.runs import private_cluster

    with tempfile.TemporaryDirectory(prefix="af-fill-") as tmp:
        model_dir, stops = checkpoint_with_stops(args.model, Path(tmp) / "ckpt", args.stop_ids)
        nodes, engine = {}, []
        with private_cluster() as cfg:
            # the engine's rate measured before and after each node run: the machine's load drifts
            for mode in args.modes.split(","):
                before = engine_rate(model_dir, args)
                node = node_rate(cfg, model_dir, Path(tmp), args, mode)
                after = engine_rate(model_dir, args)
                engine += [before, after]
                nodes[mode] = {**node, "engine_tokens_per_s": round((before + after) / 2, 1),
                               "of_engine": round(node["tokens_per_s"] / ((before + after) / 2), 3),
                               "load_average": round(os.getloadavg()[0], 1)}
                print(f"node ({mode}): {json.dumps(nodes[mode])}", flush=True)
    print(json.dumps({"benchmark": "node_fill", "model": Path(args.model).name, "rows": args.rows, "samples": args.samples,
                      "inflight_rows": args.inflight_rows, "max_new_tokens": args.max_new_tokens,
                      "stop_ids": len(stops), "torch_threads": 1,
                      "engine_tokens_per_s": round(statistics.median(engine), 1), "node": nodes, "target_of_engine": 0.8}))


if __name__ == "__main__":
    main()
