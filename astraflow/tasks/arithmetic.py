"""Arithmetic datasets: list min/max (one answer token) and multi-digit addition."""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field

from astraflow.tasks.base import DatasetConfig, GeneratedDataset, register_dataset


@register_dataset("minmax")
class MinMax(GeneratedDataset):
    """``max 3 7 1 9 =`` -> ``9``: the max or min of a list of digits.

    A one-token answer makes GRPO groups informative from the first step (a partially trained
    model spreads mass over several digits at temperature 1), and the rule generalises to unseen
    lists, so held-out accuracy measures learning rather than memorisation.
    """

    class Config(DatasetConfig):
        type: Literal["minmax"] = "minmax"
        min_len: int = Field(default=3, ge=1)
        """Shortest list."""
        max_len: int = Field(default=6, ge=1)
        """Longest list."""
        ops: tuple[Literal["max", "min"], ...] = ("max", "min")
        """Operations drawn from."""

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        cfg = self.config
        op = rng.choice(cfg.ops)
        xs = [rng.randrange(10) for _ in range(rng.randint(cfg.min_len, cfg.max_len))]
        ans = max(xs) if op == "max" else min(xs)
        return f"{op} {' '.join(map(str, xs))} =", str(ans)


@register_dataset("add")
class Addition(GeneratedDataset):
    """``12 + 7 =`` -> ``19``: addition of two non-negative integers below ``10**digits``."""

    class Config(DatasetConfig):
        type: Literal["add"] = "add"
        digits: int = Field(default=2, ge=1)
        """Digits of each operand."""

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(10**self.config.digits), rng.randrange(10**self.config.digits)
        return f"{a} + {b} =", str(a + b)
