"""The ``word_calc`` dataset and its tool-use warm-start transcripts: deterministic problems with a
held-out split by prompt, reference expressions the real calculator evaluates to the answer, and SFT
transcripts whose ids and loss masks are exactly what a ``tool_agent`` episode produces."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace

import pytest
from fakes import FakeEngine, generation

from astraflow.records import Task
from astraflow.tasks import build_dataset, split_of
from astraflow.tasks.word_calc import EXPRESSION_KEY
from astraflow.tools.base import build_tool, run_tool
from astraflow.workflows import build_workflow
from astraflow.workflows.policy import SamplingConfig, policy_client
from astraflow.workflows.tool_calls import format_tool_call
from astraflow.workflows.tool_sft import demonstration_turns, tool_use_examples

WORKFLOW = {"type": "tool_agent", "policy": "agent", "tools": [{"type": "calculator"}], "reward": "numeric_match",
            "max_turns": 2, "system_prompt": "Use the calculator, then answer."}


def test_problems_are_deterministic_and_split_by_prompt():
    a = build_dataset("word_calc", seed=3).problems("train", 50, seed=1)
    b = build_dataset("word_calc", seed=3).problems("train", 50, seed=1)
    assert a == b and [p.metadata for p in a] == [p.metadata for p in b]
    assert a != build_dataset("word_calc", seed=4).problems("train", 50, seed=1)
    held = build_dataset("word_calc", seed=3, heldout_fraction=0.2).problems("heldout", 50)
    train = build_dataset("word_calc", seed=3, heldout_fraction=0.2).problems("train", 200)
    assert not {p.prompt for p in held} & {p.prompt for p in train}
    assert all(split_of(p.prompt, 0.2) == "heldout" for p in held)
    stream = build_dataset("word_calc", seed=3).stream("train")
    drawn = [next(stream) for _ in range(20)]
    assert all(split_of(p.prompt, 0.1) == "train" and p.metadata[EXPRESSION_KEY] for p in drawn)


def test_expression_evaluates_to_the_answer_with_the_real_calculator():
    calculator = build_tool("calculator")
    problems = build_dataset("word_calc", seed=0).problems("train", 60)
    parts = [re.fullmatch(r"(\d+)([-+*])(\d+)", p.metadata[EXPRESSION_KEY]) for p in problems]
    assert all(parts) and {m.group(2) for m in parts} == {"+", "-", "*"}
    for p, m in zip(problems, parts, strict=True):
        result = asyncio.run(run_tool(calculator, {"expression": p.metadata[EXPRESSION_KEY]}))
        assert result.status == "ok" and result.text == p.answer, p
        a, b = m.group(1), m.group(3)
        assert all(100 <= int(n) <= 9999 for n in (a, b)) and p.prompt.index(a) < p.prompt.rindex(b)
        assert int(p.answer) >= 0


def test_config_is_typed():
    with pytest.raises(ValueError, match="ops"):
        build_dataset("word_calc", ops=["/"])
    with pytest.raises(ValueError, match="max_value"):
        build_dataset("word_calc", min_value=50, max_value=10)
    only_add = build_dataset("word_calc", ops=["+"], min_value=1000).problems("train", 20)
    assert all("+" in p.metadata[EXPRESSION_KEY] and int(p.answer) >= 2000 for p in only_add)


def _segments(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    out: list[tuple[int, list[int]]] = []
    for i, m in zip(ids, mask, strict=True):
        if not out or out[-1][0] != m:
            out.append((m, []))
        out[-1][1].append(i)
    return out


def test_transcript_masks_only_the_agents_turns(tiny_tokenizer):
    tok = tiny_tokenizer
    workflow = build_workflow(WORKFLOW)
    [p] = build_dataset("word_calc", seed=0).problems("train", 1)
    [ex] = tool_use_examples(workflow, [p], tok)
    segs = _segments(ex.ids, ex.loss_mask)
    assert [m for m, _ in segs] == [0, 1, 0, 1]
    prompt, call, tool, answer = (tok.decode(ids) for _, ids in segs)
    assert prompt.endswith("<|im_start|>assistant\n") and p.prompt in prompt and "Use the calculator" in prompt
    assert call == format_tool_call("calculator", {"expression": p.metadata[EXPRESSION_KEY]}) + tok.eos_token
    assert tool.startswith("\n<|im_start|>tool\n") and tool.endswith("<|im_start|>assistant\n")
    assert f"\n{p.answer}\n" in tool  # the real calculator's result
    assert answer == p.answer + tok.eos_token
    assert demonstration_turns(p, workflow.tools) == [call.removesuffix(tok.eos_token), p.answer]
    # a problem with its own demonstration keeps it
    own = replace(p, metadata={"demonstration": json.dumps(["42"])})
    assert demonstration_turns(own, workflow.tools) == ["42"]


def replay_engine(turns: list[list[int]]) -> FakeEngine:
    """Answers each turn with the next assistant segment of an SFT transcript (eos included)."""
    return FakeEngine(lambda _prompt, k: generation(turns[k], 0))


def test_transcript_ids_equal_a_tool_agent_episode(tiny_tokenizer):
    tok = tiny_tokenizer
    workflow = build_workflow(WORKFLOW)
    for p in build_dataset("word_calc", seed=0).problems("heldout", 3):
        [ex] = tool_use_examples(workflow, [p], tok)
        turns = [ids for m, ids in _segments(ex.ids, ex.loss_mask) if m == 1]
        engine = replay_engine(turns)
        client = policy_client("agent", engine, tok, SamplingConfig(max_new_tokens=64), 256)
        task = Task(prompt_id=p.prompt_id, prompt=p.prompt, answer=p.answer, samples=1, task_type="word_calc",
                    policy="", pool="default", metadata=dict(p.metadata))
        [traj] = asyncio.run(workflow.run_episode(task, {"agent": client}))
        assert [*traj.prompt_ids, *traj.response_ids] == ex.ids
        assert [0] * len(traj.prompt_ids) + list(traj.loss_mask) == ex.loss_mask
        assert traj.reward == 1.0 and len(engine.prompts) == 2
        assert traj.rewards["valid_calls"] == 1.0 and traj.rewards["tool_ok"] == 1.0
