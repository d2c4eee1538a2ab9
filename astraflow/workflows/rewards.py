"""Reward plug-ins: ``reward(response_text, task) -> float``, registered by name with typed options.

A recipe names one as ``reward: exact_match`` or ``reward: {type: last_number, tolerance: 0.01}``.

Answer-extraction rewards pull the final answer out of a free-form response — GSM8K's ``#### N``
(``hash_answer``), LaTeX ``\\boxed{...}`` (``boxed``), or the last number in the text
(``last_number``) — and compare it with the task's reference answer: as numbers when both parse
(``1,200`` == ``$1200`` == ``1200.0``), else as text without whitespace. The extraction functions
(:func:`extract_hash_answer`, :func:`extract_boxed`, :func:`extract_last_number`) and the
comparison (:func:`answers_match`) are public, so other workflows reuse them.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from astraflow.registry import PluginConfig, Registry, plugin_field
from astraflow.tasks.base import compact

if TYPE_CHECKING:
    from astraflow.records import Task


class RewardConfig(PluginConfig):
    """Options of a reward plug-in."""


class Reward(ABC):
    name: ClassVar[str] = ""
    Config: ClassVar[type[RewardConfig]] = RewardConfig

    def __init__(self, config: RewardConfig) -> None:
        self.config = config

    @abstractmethod
    def __call__(self, response: str, task: Task) -> float:
        """Reward of one decoded response to ``task`` (its reference answer is ``task.answer``)."""


REWARDS: Registry[type[Reward]] = Registry("reward")
RewardField = plugin_field(REWARDS)
"""Pydantic field type of a recipe's reward entry."""


def register_reward(name: str) -> Callable[[type[Reward]], type[Reward]]:
    """Class decorator: make a reward class buildable by ``name`` from a recipe."""
    return REWARDS.register_class(name)


def build_reward(config: RewardConfig | dict[str, Any] | str) -> Reward:
    return REWARDS.build(config)


@register_reward("exact_match")
class ExactMatch(Reward):
    """1.0 when the response equals the task's answer, ignoring whitespace."""

    class Config(RewardConfig):
        type: Literal["exact_match"] = "exact_match"

    def __call__(self, response: str, task: Task) -> float:
        return float(compact(response) == compact(task.answer))


@register_reward("numeric_match")
class NumericMatch(Reward):
    """1.0 when both parse as the same number (``07`` == ``7``); 0.0 when the response does not parse."""

    class Config(RewardConfig):
        type: Literal["numeric_match"] = "numeric_match"

    def __call__(self, response: str, task: Task) -> float:
        try:
            return float(float(compact(response)) == float(compact(task.answer)))
        except ValueError:
            return 0.0


# -- answer extraction ---------------------------------------------------------------------------
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"              # a minus sign, unless it follows an operand ("5-3" is 3)
    r"\$?"                             # a currency sign
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"  # digits, optionally grouped by thousands
    r"(?:\.\d+)?"                      # decimals
    r"|(?:(?<![\w)\]}])-)?\$?\.\d+"    # or a bare decimal fraction (".5")
)
_NUMBER_TEXT = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def extract_hash_answer(text: str) -> str | None:
    """The text after the last ``####`` (GSM8K's final-answer marker) up to the end of its line,
    stripped; None when there is none or it is empty."""
    at = text.rfind("####")
    if at < 0:
        return None
    answer = text[at + 4:].split("\n", 1)[0].strip()
    return answer or None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\boxed{...}`` (or ``\fbox{...}``), nested braces included; None
    when there is none or its braces never close."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in the text, normalised (``"$1,234.50"`` -> ``"1234.50"``, ``"-7"`` stays);
    None when the text holds no number. A minus sign directly after an operand is read as
    subtraction (``"5-3"`` -> ``"3"``)."""
    found = _NUMBER.findall(text)
    return _strip_number(found[-1]) if found else None


def parse_number(text: str) -> float | None:
    """``text`` as a number when it is one, tolerating thousands commas, a currency sign, spaces,
    a trailing full stop and LaTeX ``\\frac{a}{b}`` / ``a/b`` fractions; None otherwise."""
    t = _strip_number(text.strip().rstrip("."))
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", t) or re.fullmatch(r"(-?)([^/]+)/([^/]+)", t)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        return (-1 if frac.group(1) else 1) * num / den
    if not _NUMBER_TEXT.fullmatch(t):
        return None
    value = float(t)
    return value if math.isfinite(value) else None


def answers_match(got: str | None, want: str, tolerance: float = 1e-6) -> bool:
    """Whether an extracted answer matches the reference: numerically (within ``tolerance``,
    absolute) when both parse as numbers, else as text ignoring whitespace and a ``$...$`` wrapper."""
    if got is None:
        return False
    a, b = parse_number(got), parse_number(want)
    if a is not None and b is not None:
        return abs(a - b) <= tolerance
    return _plain(got) == _plain(want)


def _strip_number(text: str) -> str:
    return re.sub(r"[\s,$]", "", text)


def _plain(text: str) -> str:
    return compact(text).strip("$")


class AnswerRewardConfig(RewardConfig):
    """Options of the answer-extraction rewards."""

    tolerance: float = Field(default=1e-6, ge=0.0)
    """Largest absolute difference between two numeric answers still counted as equal."""
    missing: float = 0.0
    """Reward of a response with no extractable answer (e.g. a small negative format penalty)."""


class ExtractedAnswer(Reward):
    """1.0 when the answer extracted from the response matches the task's reference answer, 0.0
    when it does not, ``missing`` when the response holds none. The reference goes through the same
    extraction when it can (a GSM8K solution column ending in ``#### 72`` is the answer 72)."""

    Config: ClassVar[type[RewardConfig]] = AnswerRewardConfig
    config: AnswerRewardConfig

    @staticmethod
    @abstractmethod
    def extract(text: str) -> str | None:
        """The final answer written in ``text``, or None."""

    def __call__(self, response: str, task: Task) -> float:
        got = self.extract(response)
        if got is None:
            return self.config.missing
        want = self.extract(task.answer) or task.answer.strip()
        return float(answers_match(got, want, self.config.tolerance))


@register_reward("hash_answer")
class HashAnswer(ExtractedAnswer):
    """GSM8K style: the answer follows the last ``####`` (``... so 3 + 4 = 7\n#### 7``)."""

    class Config(AnswerRewardConfig):
        type: Literal["hash_answer"] = "hash_answer"

    extract = staticmethod(extract_hash_answer)


@register_reward("boxed")
class Boxed(ExtractedAnswer):
    """MATH style: the answer is the content of the last ``\boxed{...}``."""

    class Config(AnswerRewardConfig):
        type: Literal["boxed"] = "boxed"

    extract = staticmethod(extract_boxed)


@register_reward("last_number")
class LastNumber(ExtractedAnswer):
    """The answer is the last number in the response (``... so she has $1,250 left.`` -> 1250):
    lenient about format, for models not taught a final-answer marker."""

    class Config(AnswerRewardConfig):
        type: Literal["last_number"] = "last_number"

    extract = staticmethod(extract_last_number)
