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
    return recipe.localized()


def run_recipe(path: str, overrides: dict, seed: int, quiet: bool) -> dict:
    import torch

    from astraflow.engines import FullState, build_engine
    from astraflow.models import load_policy_model, load_policy_tokenizer
    from astraflow.raas.setup import build_recipe_workflow, end_of_turn_ids
    from astraflow.recipe.data import recipe_dataset, task_of
    from astraflow.sft import warm_start
    from astraflow.trainer.torch_backend import TorchBackend
    from astraflow.workflows.policy import policy_client

    recipe = load_recipe(path, overrides)
    t_start = time.perf_counter()
    torch.manual_seed(seed)
    dataset = recipe_dataset(recipe)
    workflow = build_recipe_workflow(recipe)
    heldout = [task_of(p, recipe) for p in dataset.problems("heldout", recipe.eval.prompts)]
    staleness = 0 if recipe.dataflow.mode == "sync" else recipe.dataflow.max_staleness
    rl = {"steps": recipe.trainer.steps, "prompts_per_step": recipe.dataflow.groups_per_batch,
          "group_size": recipe.dataset.samples, "max_staleness": staleness}

    backends, clients, history = {}, {}, {}
    result = {"recipe": recipe.run, "policies": {}}
    for pspec in recipe.policies:
        name = pspec.name
        model = load_policy_model(recipe, name)
        tokenizer = load_policy_tokenizer(recipe, name)
        sft_metrics = warm_start(model, tokenizer, recipe, name, dataset=dataset, progress=not quiet)
        backends[name] = TorchBackend(model, pspec.backend)
        engine = build_engine({"type": "hf", "seed": seed}, copy.deepcopy(model), version=0)
        clients[name] = policy_client(name, engine, tokenizer, recipe.sampling_for(name),
                                      model.config.max_position_embeddings, end_of_turn_ids(model))
        history[name] = [backends[name].state_dict()]
        result["policies"][name] = {"sft": sft_metrics, "role": recipe.role(name)}

    def evaluate(stage: str) -> None:
        for name, client in clients.items():
            result["policies"][name][stage] = asyncio.run(workflow.evaluate(name, client, heldout))

    evaluate("pre_rl")
    t_rl, cpu_rl = time.perf_counter(), time.process_time()
    stream = dataset.stream("train", seed=seed)
    curve = []
    for step in range(rl["steps"]):
        for name, client in clients.items():  # serve version (trainer version - staleness)
            v = max(0, len(history[name]) - 1 - staleness)
            if client.engine.weight_version != v:
                client.engine.update_weights(FullState(history[name][v], v))
        tasks = [task_of(p, recipe, f"{p.prompt_id}#{step}")
                 for p in (next(stream) for _ in range(rl["prompts_per_step"]))]

        async def episodes(batch):
            return await asyncio.gather(*(workflow.run_episode(t, clients) for t in batch))

        trajs = [t for ep in asyncio.run(episodes(tasks)) if ep for t in ep]
        row = {"step": step}
        for name, backend in backends.items():
            mine = [t for t in trajs if t.policy == name]
            if not mine:
                continue
            m = backend.step(mine)
            history[name].append(backend.state_dict())
            row[f"{name}/reward"] = round(m["reward_mean"], 3)
            row[f"{name}/zero_adv"] = round(m["zero_adv_frac"], 2)
            row[f"{name}/is_w"] = round(m["is_weight_mean"], 3)
        curve.append(row)
        if not quiet:
            print(json.dumps(row), flush=True)
    rl_seconds = time.perf_counter() - t_rl
    rl_cpu_seconds = time.process_time() - cpu_rl  # every thread of this process
    for name, client in clients.items():  # evaluate the final trainer weights
        client.engine.update_weights(FullState(history[name][-1], len(history[name]) - 1))
    evaluate("post_rl")
    result.update(rl_seconds=round(rl_seconds, 1), rl_cpu_seconds=round(rl_cpu_seconds, 2), wall_seconds=round(time.perf_counter() - t_start, 1),
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
