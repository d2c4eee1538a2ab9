"""Held-out evaluation with greedy decoding: solver accuracy and (balanced) verifier accuracy."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from astraflow.engines.base import Engine, SamplingParams

if TYPE_CHECKING:
    from astraflow.tasks import Dataset


def _encode(text: str) -> list[int]:
    from astraflow.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    return [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]


def _decode(ids: list[int]) -> str:
    from astraflow.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    return tok.decode([t for t in ids if t != tok.eos_token_id], skip_special_tokens=False)


def solver_accuracy(engine: Engine, dataset: Dataset, problems: list, max_new_tokens: int = 4) -> dict[str, Any]:
    """Fraction of ``problems`` answered correctly with greedy decoding."""
    gens = engine.generate([_encode(p.prompt) for p in problems],
                           SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    ok = sum(dataset.check(p, _decode(g.token_ids)) for p, g in zip(problems, gens, strict=True))
    return {"accuracy": ok / len(problems), "correct": ok, "n": len(problems)}


def verifier_accuracy(engine: Engine, problems: list, *, seed: int = 0) -> dict[str, Any]:
    """Greedy verdict accuracy on a balanced set: each problem once with its correct answer and once
    with a plausible wrong one (so always-yes or always-no scores 50%)."""
    import astraflow.tasks.verify as _v
    from astraflow.models.tokenizer import NO, YES, build_tokenizer
    from astraflow.sft import wrong_answer

    tok = build_tokenizer()
    yes, no = tok.convert_tokens_to_ids(YES), tok.convert_tokens_to_ids(NO)
    rng = random.Random(f"verifier-eval/{seed}")
    items = []
    for p in problems:
        items.append((_v.verifier_prompt(p.prompt, p.answer), yes))
        items.append((_v.verifier_prompt(p.prompt, wrong_answer(p, rng)), no))
    gens = engine.generate([_encode(t) for t, _ in items], SamplingParams(max_new_tokens=1, temperature=0.0))
    ok = sum(1 for (_, want), g in zip(items, gens, strict=True) if g.token_ids and g.token_ids[0] == want)
    return {"accuracy": ok / len(items), "correct": ok, "n": len(items)}
