"""Datasets: a tiny ABC, a registry by name with typed options, deterministic train/held-out splits.

A dataset is a class registered by name whose ``Config`` (a :class:`DatasetConfig`) is the recipe's
``dataset`` section: ``{type: jsonl, path: ..., fields: {...}, samples: 8}``. Generated datasets
draw problems from a seeded RNG (:class:`GeneratedDataset`); file datasets read rows
(``astraflow.tasks.files``). Either way the split is by a hash of the prompt, so train and held-out
never share a prompt and every component that builds the dataset sees the same split.
"""

from __future__ import annotations

import hashlib
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field

from astraflow.registry import PluginConfig, Registry, plugin_field

Split = Literal["train", "heldout"]


def compact(text: str) -> str:
    """Text without whitespace: ``"1 2"`` -> ``"12"`` (how short answers are compared)."""
    return "".join(text.split())


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer."""

    prompt_id: str
    prompt: str
    """The prompt text (the user message when the problem has no ``messages``)."""
    answer: str
    task_type: str = ""
    """Task family; "" means the dataset section's ``task_type``."""
    messages: tuple[tuple[str, str], ...] = ()
    """A chat prompt as (role, content) pairs, rendered with the policy's chat template."""
    metadata: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    """Free-form string pairs carried on the Task (difficulty, source, ...)."""


def split_of(key: str, heldout_fraction: float) -> Split:
    """Deterministic split by a hash of ``key`` (the prompt text): train and held-out never share it."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return "heldout" if h < heldout_fraction else "train"


def prompt_id_of(dataset: str, prompt: str) -> str:
    """A problem id derived from the prompt text: the same prompt is the same problem everywhere."""
    return f"{dataset}-{hashlib.sha256(prompt.encode()).hexdigest()[:12]}"


class DatasetConfig(PluginConfig):
    """Options every dataset has; subclasses add theirs and narrow ``type``."""

    seed: int | None = None
    """Seed of generation / shuffling; ``None`` uses the recipe's seed."""
    heldout_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Share of prompts kept out of training (by prompt hash) for evaluation."""
    task_type: str = "math"
    """Written on each Task unless the problem has its own; routing and mixing plug-ins key on it."""
    samples: int = Field(default=8, ge=1)
    """Trajectories per task and policy (the GRPO group size)."""
    pool: str = "default"
    """Rollout pool whose task topic receives the tasks."""


class Dataset(ABC):
    """Problems split into disjoint train and held-out sets by prompt."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[DatasetConfig]] = DatasetConfig

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config
        self.seed = config.seed or 0
        self.heldout_fraction = config.heldout_fraction

    @abstractmethod
    def problems(self, split: Split, n: int, *, seed: int | None = None) -> list[Problem]:
        """``n`` distinct problems of ``split`` (deterministic for the dataset seed and ``seed``);
        fewer only when the split has fewer."""

    @abstractmethod
    def stream(self, split: Split = "train", *, seed: int = 0) -> Iterator[Problem]:
        """An endless iterator of problems of ``split`` (repeats allowed), for task emitters."""


class GeneratedDataset(Dataset):
    """A seeded generator of (prompt, answer) pairs."""

    @abstractmethod
    def _draw(self, rng: random.Random) -> tuple[str, str]:
        """One random (prompt, answer) pair."""

    def problems(self, split: Split, n: int, *, seed: int | None = None) -> list[Problem]:
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
        rng = random.Random(f"{self.name}/{self.seed}/{split}/stream/{seed}")
        while True:
            prompt, answer = self._draw(rng)
            if split_of(prompt, self.heldout_fraction) == split:
                yield self._problem(prompt, answer)

    def _problem(self, prompt: str, answer: str) -> Problem:
        return Problem(prompt_id=prompt_id_of(self.name, prompt), prompt=prompt, answer=answer)


class ListedDataset(Dataset):
    """A finite list of problems (the rows of a file, a generated pool), split by prompt hash.

    ``problems`` is a seeded sample of a split, ``stream`` cycles over it endlessly in a fresh
    seeded order each pass: passes are not counted here (``dataflow.epochs`` counts them), and a
    stream is deterministic, so a task emitter resumes by skipping the tasks it already drew.
    """

    def __init__(self, config: DatasetConfig) -> None:
        super().__init__(config)
        self._splits: dict[str, list[Problem]] | None = None

    @abstractmethod
    def _load(self) -> list[Problem]:
        """Every problem, in a fixed order; a prompt listed twice is kept once (the first)."""

    def all_problems(self, split: Split) -> list[Problem]:
        """Every problem of ``split``, in the dataset's order (loaded once)."""
        if self._splits is None:
            self._splits = split_problems(self._load(), self.heldout_fraction)
        return self._splits[split]

    def problems(self, split: Split, n: int, *, seed: int | None = None) -> list[Problem]:
        pool = self.all_problems(split)
        rng = random.Random(f"{self.name}/{self.seed}/{split}/{seed}")
        return rng.sample(pool, min(n, len(pool)))

    def stream(self, split: Split = "train", *, seed: int = 0) -> Iterator[Problem]:
        pool = list(self.all_problems(split))
        if not pool:
            raise ValueError(f"{self.name}: the {split} split is empty")
        rng = random.Random(f"{self.name}/{self.seed}/{split}/stream/{seed}")
        while True:
            rng.shuffle(pool)
            yield from pool


def problem_key(problem: Problem) -> str:
    """What a problem is identified and split by: its chat messages (as canonical JSON) when it has
    them, else its prompt text."""
    if problem.messages:
        return json.dumps([list(m) for m in problem.messages], ensure_ascii=False, separators=(",", ":"))
    return problem.prompt


def split_problems(problems: list[Problem], heldout_fraction: float) -> dict[str, list[Problem]]:
    """``problems`` without repeated prompts, by split (see :func:`split_of`), in their order."""
    out: dict[str, list[Problem]] = {"train": [], "heldout": []}
    seen: set[str] = set()
    for p in problems:
        key = problem_key(p)
        if key not in seen:
            seen.add(key)
            out[split_of(key, heldout_fraction)].append(p)
    return out


DATASETS: Registry[type[Dataset]] = Registry("dataset")
DatasetField = plugin_field(DATASETS)
"""Pydantic field type of a recipe's dataset section."""


def register_dataset(name: str) -> Callable[[type[Dataset]], type[Dataset]]:
    """Class decorator: make a dataset class buildable by ``name`` from a recipe."""
    return DATASETS.register_class(name)


def build_dataset(config: DatasetConfig | dict[str, Any] | str, **options: Any) -> Dataset:
    """The dataset named by ``config`` (a parsed config, a recipe entry, or a name plus options)."""
    if isinstance(config, str):
        config = {"type": config, **options}
    return DATASETS.build(config)


def seeded_dataset(config: DatasetConfig, default_seed: int) -> Dataset:
    """The dataset of ``config``, seeded with ``default_seed`` (a recipe's seed) unless it sets its own."""
    if config.seed is None:
        config = config.model_copy(update={"seed": default_seed})
    return build_dataset(config)
