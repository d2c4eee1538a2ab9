"""A short supervised warm start on generated data (before RL), with a rich progress bar.

The warm start teaches the output format and part of the skill; it is kept deliberately short so
that RL has room to learn (the demo checks held-out accuracy before and after RL).
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

    from astraflow.recipe import Recipe
    from astraflow.tasks import Dataset, Problem


class SFTConfig(BaseModel):
    """Hyper-parameters of the warm start."""

    model_config = ConfigDict(extra="forbid")

    steps: int = 100
    """Optimizer steps (keep small: the point is a partial warm start)."""
    batch_size: int = 32
    """Examples per step."""
    lr: float = 3e-3
    """AdamW learning rate."""
    examples: int = 2000
    """Generated examples to cycle through."""
    seed: int = 0
    """Seed of example generation and shuffling."""


def solver_examples(dataset: Dataset, n: int, *, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, answer) pairs from the dataset's train split."""
    return [(p.prompt, p.answer) for p in dataset.problems("train", n, seed=seed)]


def verifier_examples(dataset: Dataset, n: int, *, seed: int = 0) -> list[tuple[str, str]]:
    """(verifier prompt, verdict) pairs, half with the correct answer and half with a wrong one."""
    from astraflow.models.tokenizer import NO, YES
    from astraflow.tasks.verify import verifier_prompt

    rng = random.Random(f"verifier-sft/{seed}")
    out = []
    for p in dataset.problems("train", n, seed=seed):
        good = rng.random() < 0.5
        cand = p.answer if good else wrong_answer(p, rng)
        out.append((verifier_prompt(p.prompt, cand), YES if good else NO))
    return out


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong answer: another number from the prompt when there is one, else a near miss."""
    nums = [w for w in problem.prompt.split() if w.isdigit() and w != problem.answer]
    if nums and rng.random() < 0.7:
        return rng.choice(nums)
    a = int(problem.answer) if problem.answer.isdigit() else 0
    cand = a + rng.choice([-2, -1, 1, 2, 3])
    return str(cand if cand >= 0 and cand != a else a + 1)


def supervised_finetune(model: torch.nn.Module, examples: Sequence[tuple[str, str]],
                        config: SFTConfig | dict | None = None, *, label: str = "SFT",
                        progress: bool = True) -> dict[str, Any]:
    """Train ``model`` to emit ``target <eos>`` after ``<bos> prompt`` (loss on the target only)."""
    import torch

    from astraflow.models.tokenizer import build_tokenizer

    cfg = SFTConfig.model_validate(config or {}) if not isinstance(config, SFTConfig) else config
    tok = build_tokenizer()
    rows = []
    for prompt, target in examples:
        p = [tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]
        t = [*tok.encode(target, add_special_tokens=False), tok.eos_token_id]
        rows.append((p, t))
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98))
    device = next(model.parameters()).device
    model.train()
    t0, losses = time.perf_counter(), []

    def one_step() -> float:
        batch = rng.sample(rows, min(cfg.batch_size, len(rows)))
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, t) in enumerate(batch):
            s = p + t
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            labels[i, len(p): len(s)] = torch.tensor(t)
        logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cols = [TextColumn(f"[bold cyan]{label}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn()]
        with Progress(*cols, transient=False) as bar:
            job = bar.add_task(label, total=cfg.steps, loss=float("nan"))
            for _ in range(cfg.steps):
                losses.append(one_step())
                bar.update(job, advance=1, loss=sum(losses[-10:]) / len(losses[-10:]))
    else:
        for _ in range(cfg.steps):
            losses.append(one_step())
    model.eval()
    return {"sft_steps": cfg.steps, "sft_final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "sft_seconds": time.perf_counter() - t0}


def verifier_policy(recipe: Recipe) -> str | None:
    """The policy that plays the verifier in the recipe's workflow, if any: the workflow's
    ``verifier_policy`` parameter, or the workflow's own default for it when the recipe sets none."""
    if recipe.workflow.type != "solver_verifier":
        return None
    from astraflow.workflows.solver_verifier import SolverVerifierWorkflow

    default = inspect.signature(SolverVerifierWorkflow).parameters["verifier_policy"].default
    return recipe.workflow.params.get("verifier_policy", default)


def warm_start(model: torch.nn.Module, recipe: Recipe, policy: str, *, dataset: Dataset | None = None,
               progress: bool = True) -> dict[str, Any]:
    """The recipe's warm start of ``policy``, on ``model`` in place: its ``sft`` config (defaults
    when it has none) on examples from the recipe's dataset (train split, seeded), verdicts for the
    workflow's verifier and answers otherwise. Used by ``astraflow demo`` and by a trainer that
    bootstraps a fresh model, so both start RL from the same kind of weights."""
    if dataset is None:
        from astraflow.tasks.recipe_data import recipe_dataset

        dataset = recipe_dataset(recipe)
    cfg = recipe.policy(policy).sft or SFTConfig()
    make = verifier_examples if policy == verifier_policy(recipe) else solver_examples
    return supervised_finetune(model, make(dataset, cfg.examples, seed=cfg.seed), cfg,
                               label=f"SFT {recipe.run}/{policy}", progress=progress)
