"""A short supervised warm start before RL, with a rich progress bar.

The warm start teaches the output format and part of the skill; it is kept deliberately short so
that RL has room to learn (the demo checks held-out accuracy before and after RL). What a policy
learns is its workflow's business (:meth:`Workflow.warm_start_examples`: answers, verdicts, tool-use
transcripts); this module only trains on the examples, masked to the policy's own tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from astraflow.recipe import Recipe
    from astraflow.tasks import Dataset
    from astraflow.workflows.base import SFTExample


class SFTConfig(BaseModel):
    """Hyper-parameters of the warm start."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(default=100, ge=0)
    """Optimizer steps (keep small: the point is a partial warm start)."""
    batch_size: int = Field(default=32, ge=1)
    """Examples per step."""
    lr: float = Field(default=3e-3, gt=0)
    """AdamW learning rate."""
    examples: int = Field(default=2000, ge=1)
    """Training problems turned into examples (cycled through)."""
    seed: int = 0
    """Seed of example generation and shuffling."""


def supervised_finetune(model: torch.nn.Module, examples: Sequence[SFTExample], config: SFTConfig | dict | None = None,
                        *, pad_token_id: int = 0, label: str = "SFT", progress: bool = True) -> dict[str, Any]:
    """Train ``model`` on ``examples`` (cross-entropy on the tokens whose loss mask is 1)."""
    import torch

    cfg = SFTConfig.model_validate(config or {}) if not isinstance(config, SFTConfig) else config
    if not examples:
        raise ValueError(f"{label}: no warm-start examples")
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98))
    device = next(model.parameters()).device
    model.train()
    t0, losses = time.perf_counter(), []

    def one_step() -> float:
        batch = rng.sample(list(examples), min(cfg.batch_size, len(examples)))
        width = max(len(e.ids) for e in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, e in enumerate(batch):
            row = torch.tensor(e.ids, dtype=torch.long)
            ids[i, : len(e.ids)] = row
            attn[i, : len(e.ids)] = 1
            labels[i, : len(e.ids)] = torch.where(torch.tensor(e.loss_mask, dtype=torch.bool), row, -100)
        logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    if progress and not _terminal():
        # In a log (CI, `make demo > log`) a rich bar only shows when it is done: print a line
        # every tenth of the way instead, so a long warm start is visibly alive.
        every = max(1, cfg.steps // 10)
        for i in range(cfg.steps):
            losses.append(one_step())
            if (i + 1) % every == 0 or i + 1 == cfg.steps:
                recent = losses[-10:]
                print(f"{label}: step {i + 1}/{cfg.steps} loss {sum(recent) / len(recent):.3f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    elif progress:
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
    return {"sft_steps": cfg.steps, "sft_examples": len(examples),
            "sft_final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "sft_seconds": time.perf_counter() - t0}


def _terminal() -> bool:
    from rich.console import Console

    return Console().is_terminal


def warm_start(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, policy: str, *,
               dataset: Dataset, progress: bool = True) -> dict[str, Any]:
    """The recipe's warm start of ``policy``, on ``model`` in place: its ``sft`` config (defaults
    when it has none) on the workflow's examples for that policy, from ``dataset`` (the recipe's:
    :func:`astraflow.recipe.data.recipe_dataset`; train split, seeded). Used by ``astraflow demo`` and
    by a trainer that bootstraps a fresh model, so both start RL from the same kind of weights."""
    from astraflow.workflows import build_workflow

    cfg = recipe.policy(policy).sft or SFTConfig()
    problems = dataset.problems("train", cfg.examples, seed=cfg.seed)
    examples = build_workflow(recipe.workflow).warm_start_examples(policy, problems, tokenizer, seed=cfg.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return supervised_finetune(model, examples, cfg, pad_token_id=pad, label=f"SFT {recipe.run}/{policy}",
                               progress=progress)
