"""The tool-call format of ``tool_agent``: Hermes / Qwen style calls inside an assistant turn.

A model calls a tool by writing, anywhere in its turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>

and reads the result in the next message as ``<tool_response>...</tool_response>``. This is the
format Qwen2.5 / Qwen3 / Hermes chat models were tuned on, so a user's instruct checkpoint already
speaks it. Only the first call of a turn is run (one call per turn keeps the turn structure simple:
call, result, next turn). A call the model got wrong (bad JSON, no name, unknown tool) is a
:class:`MalformedCall`: the workflow counts it and shows the error to the model as the observation.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.tools.base import Tool

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call of a known tool."""

    name: str
    arguments: dict[str, Any]


class MalformedCall(ValueError):
    """The turn opens a tool call that cannot be run; the message is what the model is shown."""


def parse_tool_call(text: str, tool_names: Collection[str]) -> ToolCall | None:
    """The first tool call in an assistant turn's text; ``None`` when the turn makes no call (it is
    the final answer). Raises :class:`MalformedCall` for a call that cannot be run."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return None
    body_start = start + len(CALL_OPEN)
    end = text.find(CALL_CLOSE, body_start)
    if end < 0:
        raise MalformedCall(f"tool call not closed with {CALL_CLOSE}")
    try:
        call = json.loads(text[body_start:end])
    except json.JSONDecodeError as exc:
        raise MalformedCall(f"tool call is not valid JSON ({exc.msg})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise MalformedCall('tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise MalformedCall("tool call arguments are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise MalformedCall("tool call arguments must be a JSON object")
    if name not in tool_names:
        raise MalformedCall(f"unknown tool {name!r}; available: {', '.join(sorted(tool_names)) or 'none'}")
    return ToolCall(name, arguments)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The text of a call in this format (for demonstrations and tests)."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)})}{CALL_CLOSE}"


def wrap_response(text: str) -> str:
    """A tool result as the model reads it, for templates that do not wrap tool messages themselves."""
    return f"{RESPONSE_OPEN}\n{text}\n{RESPONSE_CLOSE}"


def tools_section(tools: Sequence[Tool]) -> str:
    """The system-prompt text that tells the model which tools exist and how to call them (each
    tool's one-line ``description``); empty without tools."""
    if not tools:
        return ""
    lines = [f"- {t.name}: {t.description}" if t.description else f"- {t.name}" for t in tools]
    return ("You can call a tool by writing "
            f'{CALL_OPEN}{{"name": <tool name>, "arguments": {{<arguments>}}}}{CALL_CLOSE}; '
            f"its result comes back as {RESPONSE_OPEN}...{RESPONSE_CLOSE}. "
            "When you know the answer, reply without a tool call.\nTools:\n" + "\n".join(lines))
