"""Built-in tools: the calculator's arithmetic and refusals, run_tool's timeout and truncation, and
BM25 search over the shipped example corpus and a folder of text files."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pytest

from astraflow.tools import TOOLS, Tool, ToolConfig, ToolResult, build_tool, run_tool
from astraflow.tools.search import shared_index

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data" / "corpus.jsonl"


def call(tool: Tool, **arguments: Any) -> ToolResult:
    return asyncio.run(run_tool(tool, arguments))


# -- calculator ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("expression", "result"), [
    ("347*589+12", "204395"),
    ("1872/2", "936"),                 # an integral quotient reads as an integer
    ("7 // 2", "3"),
    ("-7 % 3", "2"),
    ("-(2 ** 10)", "-1024"),
    ("((1+2)*(3+4))", "21"),
    ("0.1 + 0.2", "0.3"),              # rounded, not 0.30000000000000004
    ("1/3", "0.333333333333"),
    ("2 ** -2", "0.25"),
    ("10 ** 100", "1" + "0" * 100),    # the magnitude limit itself is allowed
    ("1 ** 1000000000", "1"),          # a huge exponent of 1 costs nothing
    (" 12 ", "12"),
])
def test_calculator_evaluates_arithmetic(expression: str, result: str) -> None:
    assert call(build_tool("calculator"), expression=expression) == ToolResult(result, "ok")


@pytest.mark.parametrize(("expression", "why"), [
    ("x + 1", "names"),
    ("__import__('os').system('true')", "function calls"),
    ("abs(-3)", "function calls"),
    ("(1).real", "attribute access"),
    ("(2).bit_length()", "function calls"),
    ("[1, 2][0]", "subscripts"),
    ("'ab' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("1 < 2", "comparisons"),
    ("1 << 1000000", "that operator"),
    ("2 ^ 3", "write a\\*\\*b"),
    ("1,000 + 1", "commas"),
    ("9**9**9", "too large"),
    ("10 ** 101", "too large"),
    ("10**99 * 10**99", "too large"),
    ("0.5 ** -100000", "too large"),
    ("1e400", "too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("3 +", "not a valid arithmetic expression"),
    ("", "empty expression"),
    ("1+" * 150 + "1", "longer than 200 characters"),
    ("-" * 120 + "1", "too long"),
])
def test_calculator_refuses_with_a_readable_error(expression: str, why: str) -> None:
    result = call(build_tool("calculator"), expression=expression)
    assert result.status == "error"
    assert result.text.startswith("error: ")
    assert re.search(why, result.text), result.text


def test_calculator_refuses_bad_arguments_and_huge_powers_fast() -> None:
    tool = build_tool("calculator")
    assert call(tool, expr="1+1").status == "error"
    assert call(tool, expression=["1"]).status == "error"
    assert call(tool, expression=42) == ToolResult("42", "ok")
    t0 = time.perf_counter()
    for e in ["9**9**9", "(10**50)**(10**50)", "2**2**2**2**2**2", "99999**99999"]:
        assert call(tool, expression=e).text == "error: result too large"
    assert time.perf_counter() - t0 < 0.5  # refused from the operands' sizes, never computed


def test_calculator_options_are_typed_and_limits_configurable() -> None:
    small = build_tool({"type": "calculator", "max_expression_chars": 5, "max_magnitude": 1000})
    assert call(small, expression="123456").text == "error: expression longer than 5 characters"
    assert call(small, expression="10**4").text == "error: result too large"
    assert call(small, expression="10**3") == ToolResult("1000", "ok")
    with pytest.raises(ValueError, match="calculator.*max_nodes"):
        TOOLS.parse({"type": "calculator", "max_nodes": "many"})
    with pytest.raises(ValueError, match="calculator.*precision"):
        TOOLS.parse({"type": "calculator", "precision": 3})  # a typo is refused, naming the field


# -- run_tool ------------------------------------------------------------------------------------
class _SlowTool(Tool):
    name = "slow"

    async def call(self, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(arguments.get("sleep_s", 10))
        return "x" * 50


def test_run_tool_times_out_and_truncates() -> None:
    tool = _SlowTool(ToolConfig(type="slow", timeout_s=0.05, max_result_chars=10))
    t0 = time.perf_counter()
    result = call(tool, sleep_s=10)
    assert result == ToolResult("error: slow timed out after 0.05 s", "timeout")
    assert time.perf_counter() - t0 < 2
    assert call(tool, sleep_s=0) == ToolResult("x" * 10, "ok")


# -- search --------------------------------------------------------------------------------------
def test_search_returns_the_relevant_passage() -> None:
    tool = build_tool({"type": "search", "corpus": str(CORPUS), "top_k": 2})
    result = call(tool, query="How tall is the lighthouse at Saltmouth?")
    assert result.status == "ok"
    lines = result.text.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("Doc 1 (Title: Saltmouth) Saltmouth is the port")
    assert "41 metres" in lines[0]
    assert lines[1].startswith("Doc 2 (Title: ")
    second = call(tool, query="which planet has the moons Phobos and Deimos")
    assert second.text.startswith("Doc 1 (Title: Mars)")


def test_search_no_hits_bad_arguments_and_passage_cut() -> None:
    tool = build_tool({"type": "search", "corpus": str(CORPUS), "top_k": 1, "max_passage_chars": 40})
    assert call(tool, query="zyxwvut qqq") == ToolResult("No results for 'zyxwvut qqq'.", "ok")
    assert call(tool, q="lighthouse").status == "error"
    assert call(tool, query="  ").status == "error"
    text = call(tool, query="Brindle blue cheese tin mines").text
    assert text.startswith("Doc 1 (Title: Brindle) ") and text.endswith(" ...")
    assert len(text) < len("Doc 1 (Title: Brindle) ") + 45


def test_search_index_is_built_once_and_shared() -> None:
    a = build_tool({"type": "search", "corpus": str(CORPUS)})
    b = build_tool({"type": "search", "corpus": str(CORPUS), "top_k": 5})
    call(a, query="honeybee dance")
    call(b, query="bread yeast")
    assert shared_index(a.corpus, "en") is shared_index(b.corpus, "en")


def test_search_over_a_folder_of_text_files(tmp_path: Path) -> None:
    (tmp_path / "otters.txt").write_text("Otters hold hands while sleeping.\n\nThey eat sea urchins.\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "owls.txt").write_text("Owls turn their heads far around.")
    tool = build_tool({"type": "search", "corpus": str(tmp_path)})
    assert call(tool, query="what do otters eat").text.startswith("Doc 1 (Title: otters) They eat sea urchins.")
    assert call(tool, query="owls heads").text.startswith("Doc 1 (Title: owls) Owls turn")


def test_search_corpus_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="corpus: 'missing.jsonl' not found"):
        build_tool({"type": "search", "corpus": "missing.jsonl"})
    with pytest.raises(ValueError, match="search.*corpus"):
        TOOLS.parse({"type": "search"})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "c.jsonl").write_text('{"text": "alpha beta"}\n')
    cfg = TOOLS.parse({"type": "search", "corpus": "data/c.jsonl"})
    assert cfg.localized(tmp_path).corpus == str((tmp_path / "data" / "c.jsonl").resolve())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    tool = build_tool({"type": "search", "corpus": str(bad)})
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected .*text: Field required"):
        asyncio.run(tool.call({"query": "fine"}))
