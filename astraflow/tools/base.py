"""The tool contract: a named function a policy calls in the middle of its turn.

A tool is a class registered by name with typed options (``Config``, a :class:`ToolConfig`). The
model calls it by emitting a call in the workflow's call format; the workflow runs
:func:`run_tool` (which enforces the per-tool timeout) and appends the result, or the error, as a
``tool`` message the model reads in its next turn. Errors and timeouts are observations for the
model and counters for the metrics, never a crash of the episode.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from astraflow.registry import PluginConfig, Registry, plugin_field


class ToolConfig(PluginConfig):
    """Options every tool has; subclasses add theirs and narrow ``type``."""

    timeout_s: float = Field(default=5.0, gt=0)
    """A call still running after this long is abandoned and reported to the model as a timeout."""
    max_result_chars: int = Field(default=2000, ge=1)
    """Longer results are truncated (the context is finite)."""


class ToolError(Exception):
    """The call was refused or failed (bad arguments, evaluation error): shown to the model."""


class Tool(ABC):
    name: ClassVar[str] = ""
    Config: ClassVar[type[ToolConfig]] = ToolConfig
    description: ClassVar[str] = ""
    """One line for the system prompt: what the tool does and its arguments."""

    def __init__(self, config: ToolConfig) -> None:
        self.config = config

    @abstractmethod
    async def call(self, arguments: dict[str, Any]) -> str:
        """The result text; raises :class:`ToolError` for a call the model got wrong."""

    async def close(self) -> None:
        """Release resources (HTTP sessions, indexes)."""


@dataclass(frozen=True)
class ToolResult:
    text: str
    """What the model sees."""
    status: str
    """"ok", "error" or "timeout" (counted under ``tool_<status>``)."""


async def run_tool(tool: Tool, arguments: dict[str, Any]) -> ToolResult:
    """Call ``tool`` under its timeout; errors and timeouts become results, never exceptions."""
    try:
        text = await asyncio.wait_for(tool.call(arguments), timeout=tool.config.timeout_s)
    except TimeoutError:
        return ToolResult(f"error: {tool.name} timed out after {tool.config.timeout_s:g} s", "timeout")
    except ToolError as exc:
        return ToolResult(f"error: {exc}", "error")
    return ToolResult(text[: tool.config.max_result_chars], "ok")


TOOLS: Registry[type[Tool]] = Registry("tool")
ToolField = plugin_field(TOOLS)
"""Pydantic field type of a recipe's tool entry."""


def register_tool(name: str) -> Callable[[type[Tool]], type[Tool]]:
    """Class decorator: make a tool class buildable by ``name`` from a recipe."""
    return TOOLS.register_class(name)


def build_tool(config: ToolConfig | dict[str, Any] | str) -> Tool:
    return TOOLS.build(config)
