"""Before-rollout plug-ins: which prompts to emit."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from pydantic import Field

from astraflow.dataflow.plugins.base import PluginOptions, TaskSelector, register_plugin
from astraflow.dataflow.plugins.rng_state import rng_from_state, rng_to_state
from astraflow.records import Task
from astraflow.records.task import SOURCE_ID_KEY


def source_id(task: Task) -> str:
    return task.metadata.get(SOURCE_ID_KEY, task.prompt_id)


def zero_variance(rewards: list[float], tol: float = 1e-9) -> bool:
    return len(rewards) > 0 and max(rewards) - min(rewards) <= tol


@register_plugin("accept_all")
class AcceptAll(TaskSelector):
    """Emit every prompt in dataset order."""

    def select(self, candidates: list[Task], k: int) -> tuple[list[Task], list[Task]]:
        return candidates[:k], []


class GresoOptions(PluginOptions):
    explore_prob: float = Field(default=0.25, ge=0.0, le=1.0)
    """Probability of re-checking a prompt whose recent groups all had zero reward variance."""
    window: int = Field(default=1, ge=1)
    """How many recent groups of a prompt must all be zero-variance for it to be skipped."""
    seed: int = 0


@register_plugin("greso")
class Greso(TaskSelector):
    """GRESO-style pre-rollout filter: a prompt whose last ``window`` groups had zero reward variance
    (all right or all wrong: no learning signal) is skipped, except with probability
    ``explore_prob`` it is emitted again to re-check."""

    Options = GresoOptions

    def __init__(self, options: GresoOptions | None = None) -> None:
        super().__init__(options)
        self.rng = random.Random(self.options.seed)
        self.history: dict[str, deque[bool]] = {}

    def _is_flat(self, sid: str) -> bool:
        h = self.history.get(sid)
        return h is not None and len(h) >= self.options.window and all(h)

    def select(self, candidates: list[Task], k: int) -> tuple[list[Task], list[Task]]:
        emit: list[Task] = []
        skip: list[Task] = []
        for t in candidates:
            if len(emit) >= k:
                break
            if self._is_flat(source_id(t)) and self.rng.random() >= self.options.explore_prob:
                skip.append(t)
            else:
                emit.append(t)
        return emit, skip

    def observe(self, task: Task, policy: str, rewards: list[float]) -> None:
        h = self.history.setdefault(source_id(task), deque(maxlen=self.options.window))
        h.append(zero_variance(rewards))

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_to_state(self.rng), "history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng = rng_from_state(state["rng"])
        self.history = {k: deque(v, maxlen=self.options.window) for k, v in state["history"].items()}


class CurriculumOptions(PluginOptions):
    difficulty_key: str = "difficulty"
    """Task metadata key holding the difficulty level (any string; numbers sort numerically)."""
    target_pass_rate: float = Field(default=0.5, ge=0.0, le=1.0)
    """Levels whose recent pass rate is closest to this are emitted first."""
    pass_threshold: float = 0.5
    """A sample passes when its reward is at least this."""
    ema: float = Field(default=0.2, gt=0.0, le=1.0)
    """Weight of the newest group in a level's pass-rate average."""
    prior_pass_rate: float = Field(default=1.0, ge=0.0, le=1.0)
    """Assumed pass rate of a level never seen; 1.0 starts easy levels first (ties go to the
    lowest difficulty)."""


@register_plugin("curriculum")
class Curriculum(TaskSelector):
    """Orders candidates by how close their difficulty level's recent pass rate is to the target,
    easiest first on ties; never skips a prompt."""

    Options = CurriculumOptions

    def __init__(self, options: CurriculumOptions | None = None) -> None:
        super().__init__(options)
        self.pass_rate: dict[str, float] = {}

    def level(self, task: Task) -> str:
        return task.metadata.get(self.options.difficulty_key, "")

    @staticmethod
    def _level_order(level: str) -> tuple[int, float, str]:
        try:
            return (0, float(level), level)
        except ValueError:
            return (1, 0.0, level)

    def select(self, candidates: list[Task], k: int) -> tuple[list[Task], list[Task]]:
        o = self.options

        def rank(item: tuple[int, Task]) -> tuple[float, tuple[int, float, str], int]:
            i, t = item
            lv = self.level(t)
            return (abs(self.pass_rate.get(lv, o.prior_pass_rate) - o.target_pass_rate), self._level_order(lv), i)

        return [t for _, t in sorted(enumerate(candidates), key=rank)[:k]], []

    def observe(self, task: Task, policy: str, rewards: list[float]) -> None:
        if not rewards:
            return
        rate = sum(r >= self.options.pass_threshold for r in rewards) / len(rewards)
        lv = self.level(task)
        old = self.pass_rate.get(lv)
        self.pass_rate[lv] = rate if old is None else (1 - self.options.ema) * old + self.options.ema * rate

    def state_dict(self) -> dict[str, Any]:
        return {"pass_rate": dict(self.pass_rate)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pass_rate = dict(state["pass_rate"])
