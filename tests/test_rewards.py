"""Reward plug-ins: answer extraction (``#### N``, ``\\boxed{}``, last number), the comparison, the
typed options a recipe gives them, and refusal of unknown rewards and wrong option types."""

from __future__ import annotations

import pytest

from astraflow.records import Task
from astraflow.registry import PluginConfig
from astraflow.workflows.rewards import (
    REWARDS,
    answers_match,
    build_reward,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    parse_number,
)


def _task(answer: str) -> Task:
    return Task(prompt_id="p", prompt="q", answer=answer)


@pytest.mark.parametrize("text, expected", [
    ("3 + 4 = 7\n#### 7", "7"),
    ("#### 1,200\n", "1,200"),
    ("first #### 3\nthen #### 4 ", "4"),          # the last marker wins
    ("#### 5\nsome trailing words", "5"),        # up to the end of the marker's line
    ("#### $18", "$18"),
    ("no marker here: 12", None),
    ("####   \n", None),                         # an empty answer is no answer
])
def test_extract_hash_answer(text: str, expected: str | None) -> None:
    assert extract_hash_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    (r"so the answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),    # nested braces
    (r"\boxed{a{b{c}}d} then \boxed{ 7 }", "7"),  # the last box, stripped
    (r"\fbox{9}", "9"),
    (r"\boxed {3}", "3"),
    (r"\boxed{12", None),                        # never closed
    ("no box 12", None),
])
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("The answer is 42.", "42"),
    ("She pays $1,234.50 in total", "1234.50"),
    ("It costs $2,500,000 now", "2500000"),
    ("x = -7", "-7"),
    ("-$5 left", "-5"),
    ("5-3", "3"),                                # subtraction, not a negative number
    ("(2)-1", "1"),
    ("1,2,3", "3"),                              # a list, not thousands
    ("about .5 of it", ".5"),
    ("3.14.", "3.14"),
    ("first 12 then 34 apples", "34"),
    ("no digits", None),
])
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-7", -7.0), ("1,200", 1200.0), ("$18", 18.0), ("7.", 7.0), (" 3.5 ", 3.5),
    (r"\frac{1}{4}", 0.25), (r"-\dfrac{3}{2}", -1.5), ("3/4", 0.75), ("1e3", 1000.0),
    ("x+1", None), ("", None), ("inf", None), ("1/0", None),
])
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


def test_answers_match() -> None:
    assert answers_match("1,200", "1200") and answers_match("$1200.0", "1,200")
    assert answers_match("0.5", r"\frac{1}{2}")
    assert not answers_match("1201", "1200")
    assert answers_match("1200.4", "1200", tolerance=0.5) and not answers_match("1200.6", "1200", tolerance=0.5)
    assert answers_match("x + 1", "x+1") and answers_match("$x$", "x")  # text: whitespace and $...$ ignored
    assert not answers_match(None, "1")


def test_hash_answer_reward() -> None:
    reward = build_reward("hash_answer")
    assert reward.name == "hash_answer"
    assert reward("5 * 3 = 15\n#### 15", _task("15")) == 1.0
    assert reward("#### 1,500", _task("1500")) == 1.0
    assert reward("#### 14", _task("15")) == 0.0
    assert reward("the answer is 15", _task("15")) == 0.0   # no marker: no answer
    # a reference written as a GSM8K solution is reduced to its final answer too
    assert reward("#### 72", _task("48 + 24 = 72\n#### 72")) == 1.0


def test_boxed_reward() -> None:
    reward = build_reward({"type": "boxed"})
    assert reward(r"\boxed{\frac{3}{4}}", _task("0.75")) == 1.0
    assert reward(r"thus \boxed{x^{2}}", _task(r"\boxed{x^{2}}")) == 1.0
    assert reward(r"\boxed{5}", _task("6")) == 0.0
    assert reward("5", _task("5")) == 0.0


def test_last_number_reward_and_options() -> None:
    plain = build_reward("last_number")
    assert plain("so she has $1,250 left.", _task("1250")) == 1.0
    assert plain("12 apples minus 5 is 7", _task("7")) == 1.0
    assert plain("7 or maybe 8", _task("7")) == 0.0
    assert plain("no idea", _task("7")) == 0.0
    lenient = build_reward({"type": "last_number", "tolerance": 0.01, "missing": -0.5})
    assert lenient("about 3.333", _task("3.33")) == 1.0
    assert lenient("about 3.36", _task("3.33")) == 0.0
    assert lenient("no idea", _task("7")) == -0.5      # a format penalty when nothing is extracted


def test_reward_configs_are_typed() -> None:
    parsed = REWARDS.parse({"type": "last_number", "tolerance": "0.5"})
    assert isinstance(parsed, PluginConfig) and parsed.tolerance == 0.5
    with pytest.raises(ValueError, match=r"reward 'last_number': tolerance: .*greater than or equal to 0"):
        REWARDS.parse({"type": "last_number", "tolerance": -1})
    with pytest.raises(ValueError, match=r"reward 'boxed': tolerence: Extra inputs"):
        REWARDS.parse({"type": "boxed", "tolerence": 1})
    with pytest.raises(ValueError, match=r"unknown reward 'last_numbr'.*last_number"):
        REWARDS.parse("last_numbr")
    assert {"exact_match", "numeric_match", "hash_answer", "boxed", "last_number"} <= set(REWARDS.names())


def test_reward_in_a_recipe_is_validated(tmp_path) -> None:
    import yaml

    from astraflow.config import ConfigError
    from astraflow.recipe import Recipe

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"policies": [{"name": "policy"}],
                                    "workflow": {"type": "math", "reward": {"type": "hash_answer", "tolerance": "x"}}}))
    with pytest.raises(ConfigError, match=r"workflow.*tolerance"):
        Recipe.load(path)
