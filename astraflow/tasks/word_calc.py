"""``word_calc``: word problems with 3-4 digit numbers, meant to be solved by calling a calculator.

"Each box holds 347 coins. How many coins are in 589 boxes?" -> ``204383``. The numbers are too large
to add, subtract or multiply reliably "in the head" of a small model, so the agent learns to write the
expression (``347*589``) in a tool call and to copy the result into its answer. The templates are few,
so a tiny model can learn the operation from the wording; numbers, names and objects vary, and the
held-out split (by prompt hash) holds prompts never trained on. Each problem carries the reference
calculator expression in ``metadata["expression"]`` (used to write tool-use warm-start transcripts).
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field, model_validator

from astraflow.tasks.base import DatasetConfig, GeneratedDataset, Problem, prompt_id_of, register_dataset

Op = Literal["+", "-", "*"]

TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": ("{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
          "A shop sold {a} {thing} on Monday and {b} on Tuesday. How many {thing} did it sell?"),
    "-": ("{name} had {a} {thing} and gave away {b}. How many are left?",
          "A store has {a} {thing} and sells {b} of them. How many {thing} remain?"),
    "*": ("Each box holds {a} {thing}. How many {thing} are in {b} boxes?",
          "{name} buys {a} packs of {b} {thing}. How many {thing} is that?"),
}
"""Problem wordings per operation; ``{a} op {b}`` is the reference expression."""

NAMES = ("Ann", "Ben", "Cara", "Dev", "Emma", "Finn", "Gus", "Hana", "Ivan", "Jo", "Kim", "Leo", "Mia", "Ned")
THINGS = ("apples", "sheep", "books", "coins", "stamps", "marbles", "tickets", "bottles", "cards", "shells",
          "eggs", "bricks", "seeds")

EXPRESSION_KEY = "expression"
"""``Problem.metadata`` key of the reference calculator expression (``"347+589"``)."""


def evaluate_expression(a: int, op: str, b: int) -> int:
    """``a op b`` for the dataset's operations."""
    return a + b if op == "+" else a - b if op == "-" else a * b


@register_dataset("word_calc")
class WordCalc(GeneratedDataset):
    """Templated word problems ``a op b`` with 3-4 digit operands and an integer answer."""

    class Config(DatasetConfig):
        type: Literal["word_calc"] = "word_calc"
        task_type: str = "word_calc"
        """Written on each Task (routing and mixing plug-ins key on it)."""
        ops: tuple[Op, ...] = ("+", "-", "*")
        """Operations drawn from (uniformly)."""
        min_value: int = Field(default=100, ge=0)
        """Smallest operand."""
        max_value: int = Field(default=9999, ge=1)
        """Largest operand."""
        templates_per_op: int = Field(default=2, ge=1, le=2)
        """Wordings used per operation (the first N of ``TEMPLATES[op]``)."""

        @model_validator(mode="after")
        def _check(self) -> WordCalc.Config:
            if self.min_value > self.max_value:
                raise ValueError(f"min_value {self.min_value} exceeds max_value {self.max_value}")
            if not self.ops:
                raise ValueError("ops: at least one operation")
            return self

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        cfg = self.config
        op = rng.choice(cfg.ops)
        template = rng.choice(TEMPLATES[op][: cfg.templates_per_op])
        a, b = rng.randint(cfg.min_value, cfg.max_value), rng.randint(cfg.min_value, cfg.max_value)
        if op == "-" and a < b:
            a, b = b, a
        prompt = template.format(name=rng.choice(NAMES), thing=rng.choice(THINGS), a=a, b=b)
        # GeneratedDataset turns each draw into a Problem (``_problem``) right after drawing it.
        self._drawn = (prompt, f"{a}{op}{b}")
        return prompt, str(evaluate_expression(a, op, b))

    def _problem(self, prompt: str, answer: str) -> Problem:
        drawn, expression = getattr(self, "_drawn", ("", ""))
        if drawn != prompt:
            raise RuntimeError("word_calc: a problem must be built from the latest draw")
        return Problem(prompt_id=prompt_id_of(self.name, prompt), prompt=prompt, answer=answer,
                       metadata={EXPRESSION_KEY: expression})
