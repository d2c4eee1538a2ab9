"""Tool-use warm-start transcripts: a problem with a reference calculator expression becomes the
episode an expert agent would have, token for token as ``tool_agent`` builds it at RL time.

For a problem whose ``metadata["expression"]`` is ``"347+589"`` (the ``word_calc`` dataset writes it)::

    <rendered system (tools section) + user prompt>                                  loss_mask 0
    <tool_call>{"name": "calculator", "arguments": {"expression": "347+589"}}</tool_call><eos>   1
    <tool message framing + the real calculator's result + next assistant opening>   loss_mask 0
    936<eos>                                                                          loss_mask 1

The framing and the tool result come from :meth:`ToolAgentWorkflow.demonstration` (the same
``message_ids`` / ``_frame`` / ``run_tool`` an episode uses), so SFT and RL agree on every id.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from astraflow.workflows.tool_calls import format_tool_call

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from astraflow.tasks import Problem
    from astraflow.workflows.base import SFTExample
    from astraflow.workflows.tool_agent import ToolAgentWorkflow

EXPRESSION_KEY = "expression"
"""``Problem.metadata`` key of the reference expression (as in :mod:`astraflow.tasks.word_calc`)."""
CALCULATOR = "calculator"
"""Registered name of the calculator tool the demonstrations call."""


def demonstration_turns(problem: Problem, tool_names: list[str] | tuple[str, ...] | dict) -> list[str]:
    """The assistant turns an expert writes for ``problem``: the problem's own ``demonstration``
    (JSON list of turns) when it has one; else a calculator call of its reference ``expression``
    (when the calculator is one of ``tool_names``), then the answer; else just the answer."""
    from astraflow.workflows.tool_agent import DEMONSTRATION_KEY

    raw = problem.metadata.get(DEMONSTRATION_KEY)
    if raw:
        return list(json.loads(raw))
    expression = problem.metadata.get(EXPRESSION_KEY)
    if expression and CALCULATOR in tool_names:
        return [format_tool_call(CALCULATOR, {"expression": expression}), problem.answer]
    return [problem.answer]


def tool_use_examples(workflow: ToolAgentWorkflow, problems: list[Problem], tokenizer: PreTrainedTokenizerBase,
                      seed: int = 0) -> list[SFTExample]:
    """One SFT example per problem: the whole tool-using episode of :func:`demonstration_turns`,
    framed exactly as ``workflow`` frames its episodes, trained on the assistant turns only.
    (``seed`` is accepted for the warm-start contract; the transcripts are deterministic.)"""
    from astraflow.workflows.policy import problem_messages

    del seed
    return [workflow.demonstration(tokenizer, problem_messages(p, workflow.system),
                                   demonstration_turns(p, workflow.tools))
            for p in problems]
