"""Tools a policy calls mid-turn (see :mod:`astraflow.tools.base` for the contract).

Importing this package registers the built-ins by name: ``calculator`` (safe arithmetic) and
``search`` (BM25 over a local corpus). A user's tool registers itself the same way, with
:func:`register_tool`, when its module is imported.
"""

from astraflow.tools.base import (
    TOOLS,
    Tool,
    ToolConfig,
    ToolError,
    ToolField,
    ToolResult,
    build_tool,
    register_tool,
    run_tool,
)
from astraflow.tools.calculator import CalculatorTool
from astraflow.tools.search import SearchTool

__all__ = [
    "TOOLS",
    "CalculatorTool",
    "SearchTool",
    "Tool",
    "ToolConfig",
    "ToolError",
    "ToolField",
    "ToolResult",
    "build_tool",
    "register_tool",
    "run_tool",
]
