"""Generated datasets with checkable answers: a tiny ABC, a registry by name, seeded splits."""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from astraflow.models.tokenizer import compact
from astraflow.registry import Registry

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer (answers are compared without whitespace)."""

    prompt_id: str
    prompt: str
    answer: str


def split_of(prompt: str, heldout_fraction: float) -> Split:
    """Deterministic split by the prompt text's hash: train and held-out never share a prompt."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64
    return "heldout" if h < heldout_fraction else "train"


class Dataset(ABC):
    """A seeded generator of problems, split into disjoint train and held-out sets by prompt."""

    name: str = ""

    def __init__(self, seed: int = 0, heldout_fraction: float = 0.1) -> None:
        self.seed = seed
        self.heldout_fraction = heldout_fraction

    @abstractmethod
    def _draw(self, rng: random.Random) -> tuple[str, str]:
        """One random (prompt, answer) pair."""

    def check(self, problem: Problem, response: str) -> bool:
        """Whether a decoded response answers the problem."""
        return compact(response) == problem.answer

    def problems(self, split: Split, n: int, *, seed: int | None = None) -> list[Problem]:
        """``n`` distinct problems of ``split`` (deterministic for the dataset seed and ``seed``)."""
        rng = random.Random(f"{self.name}/{self.seed}/{split}/{seed}")
        out: dict[str, Problem] = {}
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 200 * n + 1000:
                raise ValueError(f"{self.name}: cannot draw {n} distinct {split} problems")
            prompt, answer = self._draw(rng)
            if prompt in out or split_of(prompt, self.heldout_fraction) != split:
                continue
            out[prompt] = self._problem(prompt, answer)
        return list(out.values())

    def stream(self, split: Split = "train", *, seed: int = 0) -> Iterator[Problem]:
        """An endless iterator of problems of ``split`` (repeats allowed), for task emitters."""
        rng = random.Random(f"{self.name}/{self.seed}/{split}/stream/{seed}")
        while True:
            prompt, answer = self._draw(rng)
            if split_of(prompt, self.heldout_fraction) == split:
                yield self._problem(prompt, answer)

    def _problem(self, prompt: str, answer: str) -> Problem:
        """The problem with its id: derived from the prompt text, so the same prompt drawn by
        ``problems`` or ``stream`` is the same problem."""
        pid = f"{self.name}-{hashlib.sha256(prompt.encode()).hexdigest()[:12]}"
        return Problem(prompt_id=pid, prompt=prompt, answer=answer)


DATASETS: Registry[type[Dataset]] = Registry("dataset")


def register_dataset(name: str) -> Callable[[type[Dataset]], type[Dataset]]:
    def deco(cls: type[Dataset]) -> type[Dataset]:
        DATASETS.register(name)(cls)
        cls.name = name
        return cls
    return deco


def build_dataset(name: str, **kwargs) -> Dataset:
    """The dataset registered under ``name`` (kwargs go to its constructor)."""
    return DATASETS.get(name)(**kwargs)
