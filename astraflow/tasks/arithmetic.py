"""Arithmetic datasets: list min/max (one answer token) and multi-digit addition."""

from __future__ import annotations

import random

from astraflow.tasks.base import Dataset, register_dataset


@register_dataset("minmax")
class MinMax(Dataset):
    """``max 3 7 1 9 =`` -> ``9``: the max or min of a list of digits.

    A one-token answer makes GRPO groups informative from the first step (a partially trained
    model spreads mass over several digits at temperature 1), and the rule generalises to unseen
    lists, so held-out accuracy measures learning rather than memorisation.
    """

    def __init__(self, seed: int = 0, heldout_fraction: float = 0.1, min_len: int = 3,
                 max_len: int = 6, ops: tuple[str, ...] = ("max", "min")) -> None:
        super().__init__(seed, heldout_fraction)
        self.min_len, self.max_len, self.ops = min_len, max_len, tuple(ops)

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        op = rng.choice(self.ops)
        xs = [rng.randrange(10) for _ in range(rng.randint(self.min_len, self.max_len))]
        ans = max(xs) if op == "max" else min(xs)
        return f"{op} {' '.join(map(str, xs))} =", str(ans)


@register_dataset("add")
class Addition(Dataset):
    """``12 + 7 =`` -> ``19``: addition of two non-negative integers below ``10**digits``."""

    def __init__(self, seed: int = 0, heldout_fraction: float = 0.1, digits: int = 2) -> None:
        super().__init__(seed, heldout_fraction)
        self.digits = digits

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        return f"{a} + {b} =", str(a + b)
