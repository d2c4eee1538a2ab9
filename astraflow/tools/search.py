"""The ``search`` tool: BM25 retrieval over a local text corpus, in the style of AstraFlow's search
recipe (Search-R1): arguments ``{"query": "..."}``, result the top passages as::

    Doc 1 (Title: Harrowgate) Harrowgate is a river town ...
    Doc 2 (Title: ...) ...

The corpus is a JSONL file of ``{"id"?, "title"?, "text"}`` objects, or a folder of ``.txt`` files
(each paragraph, separated by a blank line, is one passage titled by its file's name). Ranking is
``bm25s`` (sparse BM25 on numpy, maintained, no other dependency) with its own tokenizer and an
English stop-word list; no stemming, so the tool behaves the same with or without optional extras.

The index is built once per process, on the first call, and shared by every ``search`` tool that
names the same corpus (the workflow's many concurrent episodes, several workflows). Building and
querying run in a worker thread so the node's event loop keeps serving the other episodes; on a very
large corpus the first call may time out (the model is told), and later calls use the finished index.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from astraflow.tools.base import Tool, ToolConfig, ToolError, register_tool


class SearchConfig(ToolConfig):
    """Options of the search tool."""

    type: Literal["search"] = "search"
    corpus: str
    """JSONL file of ``{"id"?, "title"?, "text"}`` or a folder of ``.txt`` files; a relative path
    is taken against the recipe's folder when it is there (:meth:`localized`), else the working dir."""
    top_k: int = Field(default=3, ge=1, le=50)
    """Passages returned per query."""
    max_passage_chars: int = Field(default=500, ge=20)
    """Each passage's text is cut to this many characters (the whole result is also capped by
    ``max_result_chars``)."""
    stopwords: str | None = "en"
    """Stop-word list of ``bm25s`` (a language such as ``en``), or ``None`` to keep every word."""

    def localized(self, base: Path | None) -> SearchConfig:
        """The options with ``corpus`` made absolute (against ``base``, the recipe's folder, when
        it is there, else the working dir); ValueError naming ``corpus`` when it is missing."""
        return self.model_copy(update={"corpus": str(locate_corpus(self.corpus, base))})


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str


@register_tool("search")
class SearchTool(Tool):
    """Top-k BM25 passages of a local corpus for the model's query."""

    Config = SearchConfig
    config: SearchConfig
    description = 'search a text collection; arguments: {"query": "<keywords or a question>"}'

    def __init__(self, config: SearchConfig) -> None:
        super().__init__(config)
        self.corpus = locate_corpus(config.corpus, None)  # fail when the workflow is built, not mid-run

    async def call(self, arguments: dict[str, Any]) -> str:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolError('expected arguments {"query": "<keywords or a question>"}')
        hits = await asyncio.to_thread(self._search, query)
        if not hits:
            return f"No results for {query.strip()!r}."
        return "\n".join(format_passage(i, p, self.config.max_passage_chars) for i, p in enumerate(hits, 1))

    def _search(self, query: str) -> list[Passage]:
        return shared_index(self.corpus, self.config.stopwords).search(query, self.config.top_k)


def format_passage(rank: int, passage: Passage, max_chars: int) -> str:
    """``Doc <rank> (Title: <title>) <text>``, the text cut at a word boundary to ``max_chars``."""
    text = " ".join(passage.text.split())
    if len(text) > max_chars:
        text = text[:max_chars].rsplit(" ", 1)[0] + " ..."
    return f"Doc {rank} (Title: {passage.title}) {text}" if passage.title else f"Doc {rank} {text}"


# -- the corpus ----------------------------------------------------------------------------------
def locate_corpus(path: str, base: Path | None) -> Path:
    """``path`` as an absolute path: against ``base`` when it is there, else the working dir."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [*([base / p] if base is not None else []), Path.cwd() / p]
    for c in candidates:
        if c.is_file() or c.is_dir():
            return c.resolve()
    where = " and ".join(dict.fromkeys(str(c.resolve()) for c in candidates))
    raise ValueError(f"corpus: {path!r} not found (looked for {where})")


def load_corpus(path: Path) -> list[Passage]:
    """The passages of a JSONL file or a folder of ``.txt`` files; ValueError naming the file
    (and line) of anything malformed, or an empty corpus."""
    passages = _load_folder(path) if path.is_dir() else _load_jsonl(path)
    if not passages:
        raise ValueError(f"corpus {path}: no passages")
    return passages


def _load_jsonl(path: Path) -> list[Passage]:
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = _Row.model_validate_json(line)
            except ValidationError as exc:
                why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in exc.errors())
                raise ValueError(f'corpus {path}:{n}: expected {{"id"?, "title"?, "text"}} ({why})') from None
            out.append(Passage(str(n if row.id is None else row.id), row.title or "", row.text))
    return out


class _Row(BaseModel):
    """One JSONL line of a corpus (other keys are ignored)."""

    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)
    id: str | None = None
    title: str | None = None
    text: str


def _load_folder(path: Path) -> list[Passage]:
    out = []
    for file in sorted(path.rglob("*.txt")):
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", file.read_text(encoding="utf-8"))]
        rel = file.relative_to(path).as_posix()
        out += [Passage(f"{rel}#{i}", file.stem, p) for i, p in enumerate(filter(None, paragraphs))]
    return out


# -- the index -----------------------------------------------------------------------------------
class Bm25Index:
    """A ``bm25s`` index of passages with the tokenizer that maps queries into its vocabulary."""

    def __init__(self, passages: list[Passage], stopwords: str | None) -> None:
        import bm25s  # numpy only; imported when a search tool is first used
        from bm25s.tokenization import Tokenizer

        self.passages = passages
        self.tokenizer = Tokenizer(stopwords=stopwords or [], stemmer=None)
        ids = self.tokenizer.tokenize([f"{p.title}\n{p.text}" for p in passages],
                                      return_as="ids", show_progress=False)
        self.retriever = bm25s.BM25()
        self.retriever.index(ids, show_progress=False)

    def search(self, query: str, k: int) -> list[Passage]:
        """The best ``k`` passages with a positive score (none when no query word is indexed)."""
        ids = self.tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)
        docs, scores = self.retriever.retrieve(ids, k=min(k, len(self.passages)), show_progress=False)
        return [self.passages[int(d)] for d, s in zip(docs[0], scores[0], strict=True) if s > 0]


_INDEXES: dict[tuple[Path, str | None], Bm25Index] = {}
_BUILDING = threading.Lock()


def shared_index(corpus: Path, stopwords: str | None) -> Bm25Index:
    """The process's index of ``corpus``, built on first use (once, even under concurrent calls)."""
    key = (corpus, stopwords)
    index = _INDEXES.get(key)
    if index is None:
        with _BUILDING:
            index = _INDEXES.get(key)
            if index is None:
                index = _INDEXES[key] = Bm25Index(load_corpus(corpus), stopwords)
    return index
