"""The ``calculator`` tool: exact arithmetic a small model cannot do reliably in its head.

Arguments ``{"expression": "347*589+12"}``; the result is the value as text (``"204395"``).

Evaluation is a small whitelist over Python's ``ast``, not ``eval`` and not a library: numbers
(int and float literals), ``+ - * / // % **``, unary ``-``/``+`` and parentheses — nothing else
parses into an accepted node, so names, calls, attribute access, subscripts, strings, comparisons
and comprehensions are refused before anything is evaluated. ``simpleeval`` was considered and
rejected: even with no names and no functions it still evaluates ``(1).real``,
``(2).bit_length()``, ``'ab'*3``, ``'abc'[1]``, ``1<2`` and ``1j``, and it bounds only the
exponent, not the size of a product (``10**4000000 * 10**4000000`` runs), so it would take more
overriding than this whitelist is long.

Cost is bounded by construction, so a call returns in microseconds and never blocks the event
loop: the expression's length and node count are capped, and every intermediate value's
magnitude is capped (a power is refused from its operands' sizes *before* it is computed, so
``9**9**9`` costs nothing). The tool's ``timeout_s`` still applies through
:func:`~astraflow.tools.base.run_tool`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from astraflow.tools.base import Tool, ToolConfig, ToolError, register_tool

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorConfig(ToolConfig):
    """Options of the calculator; the defaults suit word problems and leave room for science."""

    type: Literal["calculator"] = "calculator"
    max_expression_chars: int = Field(default=200, ge=1, le=10_000)
    """Longer expressions are refused (a model looping on digits should not cost parse time)."""
    max_nodes: int = Field(default=100, ge=1, le=10_000)
    """Most syntax-tree nodes (numbers and operators) in one expression."""
    max_magnitude: float = Field(default=1e100, gt=0)
    """Largest absolute value of any intermediate result; bounds the cost of every operation."""
    significant_digits: int = Field(default=12, ge=1, le=17)
    """Significant digits of a non-integer result (``1/3`` -> ``0.333333333333``)."""


@register_tool("calculator")
class CalculatorTool(Tool):
    """Evaluates one arithmetic expression (see the module docstring for what is accepted)."""

    Config = CalculatorConfig
    config: CalculatorConfig
    description = ('evaluate an arithmetic expression with + - * / // % ** and parentheses; '
                   'arguments: {"expression": "347*589+12"}')

    async def call(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if isinstance(expression, int | float) and not isinstance(expression, bool):
            expression = str(expression)
        if not isinstance(expression, str):
            raise ToolError('expected arguments {"expression": "<arithmetic expression>"}')
        return format_number(evaluate(expression, self.config), self.config.significant_digits)


def evaluate(expression: str, limits: CalculatorConfig) -> Number:
    """The value of ``expression`` under ``limits``; :class:`ToolError` with a short reason the
    model can act on for anything else."""
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > limits.max_expression_chars:
        raise ToolError(f"expression longer than {limits.max_expression_chars} characters")
    if "^" in text:
        raise ToolError("'^' is not a power here; write a**b")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError("not a valid arithmetic expression") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > limits.max_nodes:
        raise ToolError(f"expression too long ({nodes} parts; at most {limits.max_nodes})")
    return _Evaluator(limits.max_magnitude).value(tree.body)


class _Evaluator:
    """Walks an accepted tree; every value it returns is a finite real within ``max_magnitude``."""

    def __init__(self, max_magnitude: float) -> None:
        self.max_magnitude = max_magnitude

    def value(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ToolError(f"only numbers are allowed, not {type(v).__name__} {v!r}"[:120])
            return self.checked(v)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.checked(_UNARY[type(node.op)](self.value(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.value(node.left), self.value(node.right)
            if isinstance(node.op, ast.Pow):
                self.check_power(left, right)
            try:
                out = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
            return self.checked(out)
        raise ToolError(f"not allowed in an arithmetic expression: {_describe(node)}")

    def check_power(self, base: Number, exponent: Number) -> None:
        """Refuse ``base ** exponent`` when its result would exceed the magnitude limit, from the
        operands' sizes alone (computing it first is the denial of service)."""
        if abs(base) <= 1 or exponent <= 0:
            return  # |result| <= 1, or a float power whose overflow Python raises (caught by value())
        if math.log10(abs(base)) * exponent > math.log10(self.max_magnitude):
            raise ToolError("result too large")

    def checked(self, v: Any) -> Number:
        if isinstance(v, complex):
            raise ToolError("result is not a real number")
        if isinstance(v, float) and not math.isfinite(v):
            raise ToolError("result too large" if math.isinf(v) else "result is not a number")
        if abs(v) > self.max_magnitude:
            raise ToolError("result too large")
        return v


def _describe(node: ast.AST) -> str:
    """What the model wrote, in words: a name, a call, an attribute, a comparison, ..."""
    kinds = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attribute access",
             ast.Subscript: "subscripts", ast.Compare: "comparisons", ast.BoolOp: "and/or",
             ast.BinOp: "that operator", ast.UnaryOp: "that operator",
             ast.Tuple: "commas (write 1000, not 1,000)"}
    return kinds.get(type(node), type(node).__name__)


def format_number(v: Number, significant_digits: int = 12) -> str:
    """An integer (or an integral float below 1e15) as digits, anything else rounded to
    ``significant_digits`` (``1872/2`` -> ``936``, ``0.1+0.2`` -> ``0.3``)."""
    if isinstance(v, int):
        return str(v)
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.{significant_digits}g}"
