#!/usr/bin/env python
"""Dev harness: SFT warm start then GRPO in ONE process (no Kafka, no S3), to prove that the ML core
learns and to tune the demo recipes. Prints pre/post held-out greedy accuracy and wall time.

    nice -n 10 python scripts/rl_inprocess.py examples/recipes/math.yaml examples/recipes/solver_verifier.yaml

Staleness is simulated: the engines sample batch k with the weights of version k - max_staleness,
so the behaviour log-probs are really off-policy and the truncated importance weight is exercised.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import sys
import time
from pathlib import Path

import yaml


def run_recipe(path: str, overrides: dict, seed: int, quiet: bool) -> dict:
    import torch

    from astraflow.engines import build_engine
    from astraflow.models import build_model
    from astraflow.records import Task
    from astraflow.sft import SFTConfig, solver_examples, supervised_finetune, verifier_examples
    from astraflow.tasks import build_dataset
    from astraflow.trainer import TorchBackend
    from astraflow.workflows import build_workflow
    from astraflow.workflows.evaluate import solver_accuracy, verifier_accuracy

    recipe = yaml.safe_load(Path(path).read_text())
    for dotted, value in overrides.items():  # e.g. rl.steps=20 policies.policy.trainer.lr=1e-3
        node = recipe
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    t_start = time.perf_counter()
    torch.manual_seed(seed)
    task_cfg = dict(recipe["task"])
    dataset = build_dataset(task_cfg.pop("dataset"), **task_cfg)
    wf_cfg = dict(recipe["workflow"])
    workflow = build_workflow(wf_cfg.pop("type"), **wf_cfg)
    heldout = dataset.problems("heldout", recipe["eval"]["heldout_prompts"])
    rl = recipe["rl"]

    backends, engines, history = {}, {}, {}
    result = {"recipe": recipe["name"], "policies": {}}
    for name, pcfg in recipe["policies"].items():
        model = build_model(recipe["model"])
        sft = SFTConfig.model_validate(pcfg["sft"])
        is_verifier = name == recipe["workflow"].get("verifier_policy")
        data = (verifier_examples if is_verifier else solver_examples)(dataset, sft.examples, seed=sft.seed)
        sft_metrics = supervised_finetune(model, data, sft, label=f"SFT {name}", progress=not quiet)
        backends[name] = TorchBackend(model, pcfg["trainer"])
        engines[name] = build_engine({"seed": seed}, copy.deepcopy(model), version=0)
        history[name] = [backends[name].state_dict()]
        result["policies"][name] = {"sft": sft_metrics, "verifier": is_verifier}

    def evaluate(stage: str) -> None:
        for name, eng in engines.items():
            r = result["policies"][name]
            acc = (verifier_accuracy(eng, heldout) if r["verifier"]
                   else solver_accuracy(eng, dataset, heldout))
            r[stage] = acc

    evaluate("pre_rl")
    t_rl = time.perf_counter()
    stream = dataset.stream("train", seed=seed)
    rng = random.Random(seed)
    curve = []
    for step in range(rl["steps"]):
        for name, eng in engines.items():  # serve version (trainer version - staleness)
            v = max(0, len(history[name]) - 1 - rl.get("max_staleness", 0))
            if eng.weight_version != v:
                eng.load_weights(history[name][v], v)
        tasks = []
        for _ in range(rl["prompts_per_step"]):
            p = next(stream)
            tasks.append(Task(prompt_id=f"{p.prompt_id}#{step}", prompt=p.prompt, answer=p.answer,
                              samples=rl["group_size"], task_type=dataset.name))

        async def episodes():
            return await asyncio.gather(*(workflow.run_episode(t, engines) for t in tasks))

        trajs = [t for ep in asyncio.run(episodes()) if ep for t in ep]
        row = {"step": step}
        for name, backend in backends.items():
            mine = [t for t in trajs if t.policy == name]
            m = backend.step(mine)
            history[name].append(backend.state_dict())
            row[f"{name}/reward"] = round(m["reward_mean"], 3)
            row[f"{name}/zero_adv"] = round(m["zero_adv_frac"], 2)
            row[f"{name}/is_w"] = round(m["is_weight_mean"], 3)
        curve.append(row)
        if not quiet:
            print(json.dumps(row), flush=True)
    rl_seconds = time.perf_counter() - t_rl
    for name, eng in engines.items():  # evaluate the final trainer weights
        eng.load_weights(history[name][-1], len(history[name]) - 1)
    evaluate("post_rl")
    result.update(rl_seconds=round(rl_seconds, 1), wall_seconds=round(time.perf_counter() - t_start, 1),
                  rl=rl, reward_first5={k: v for k, v in curve[0].items()} if curve else {},
                  reward_last={k: v for k, v in curve[-1].items()} if curve else {})
    del rng
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--set", nargs="*", default=[], help="dotted.key=value overrides (YAML values)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    t0 = time.perf_counter()
    for path in args.recipes:
        res = run_recipe(path, overrides, args.seed, args.quiet)
        print("RESULT " + json.dumps(res), flush=True)
        for name, r in res["policies"].items():
            print(f"  {res['recipe']}/{name}: held-out accuracy {r['pre_rl']['accuracy']:.3f} -> "
                  f"{r['post_rl']['accuracy']:.3f} (n={r['post_rl']['n']}), SFT {r['sft']['sft_seconds']:.1f}s, "
                  f"RL {res['rl_seconds']}s", flush=True)
    print(f"TOTAL wall {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
