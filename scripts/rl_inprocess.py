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
import sys
import time
from pathlib import Path

import yaml


def load_recipe(path: str, overrides: dict):
    """The recipe (astraflow.recipe.Recipe) with dotted overrides applied, e.g.
    ``trainer.steps=20`` or ``policies.0.backend.lr=1e-3``."""
    from astraflow.recipe import Recipe

    data = yaml.safe_load(Path(path).read_text())
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        if isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
    recipe = Recipe.model_validate(data)
    recipe.source = Path(path).resolve()
    return recipe


def run_recipe(path: str, overrides: dict, seed: int, quiet: bool) -> dict:
    import torch

    from astraflow.engines import build_engine
    from astraflow.raas.setup import build_recipe_workflow
    from astraflow.records import Task
    from astraflow.sft import (
        SFTConfig,
        solver_examples,
        supervised_finetune,
        verifier_examples,
        verifier_policy,
    )
    from astraflow.tasks.recipe_data import recipe_dataset
    from astraflow.trainer import TorchBackend
    from astraflow.workflows.evaluate import solver_accuracy, verifier_accuracy

    recipe = load_recipe(path, overrides)
    t_start = time.perf_counter()
    torch.manual_seed(seed)
    dataset = recipe_dataset(recipe)
    workflow = build_recipe_workflow(recipe)
    heldout = dataset.problems("heldout", recipe.eval.prompts)
    staleness = 0 if recipe.dataflow.mode == "sync" else recipe.dataflow.max_staleness
    rl = {"steps": recipe.trainer.steps, "prompts_per_step": recipe.dataflow.groups_per_batch,
          "group_size": recipe.dataset.samples, "max_staleness": staleness}
    verifier_name = verifier_policy(recipe)

    backends, engines, history = {}, {}, {}
    result = {"recipe": recipe.run, "policies": {}}
    for pspec in recipe.policies:
        name = pspec.name
        model = recipe.build_policy_model(name)
        sft = pspec.sft or SFTConfig()
        is_verifier = name == verifier_name
        data = (verifier_examples if is_verifier else solver_examples)(dataset, sft.examples, seed=sft.seed)
        sft_metrics = supervised_finetune(model, data, sft, label=f"SFT {name}", progress=not quiet)
        backends[name] = TorchBackend(model, pspec.backend)
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
    curve = []
    for step in range(rl["steps"]):
        for name, eng in engines.items():  # serve version (trainer version - staleness)
            v = max(0, len(history[name]) - 1 - staleness)
            if eng.weight_version != v:
                eng.load_weights(history[name][v], v)
        tasks = []
        for _ in range(rl["prompts_per_step"]):
            p = next(stream)
            tasks.append(Task(prompt_id=f"{p.prompt_id}#{step}", prompt=p.prompt, answer=p.answer,
                              samples=rl["group_size"], task_type=dataset.name))

        async def episodes(batch):
            return await asyncio.gather(*(workflow.run_episode(t, engines) for t in batch))

        trajs = [t for ep in asyncio.run(episodes(tasks)) if ep for t in ep]
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
