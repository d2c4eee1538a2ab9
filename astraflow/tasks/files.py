"""Datasets from files: JSONL and Parquet rows, local or ``s3://bucket/key``, with a field mapping.

A recipe names the file and which of its columns hold what::

    dataset:
      type: jsonl                       # or parquet
      path: ../data/word_problems.jsonl # relative to the recipe file, else to the working dir
      fields: {prompt: question, answer: answer, metadata: [difficulty]}

A prompt is either text (``fields.prompt``, sent as one user message) or a chat (``fields.messages``,
a list of ``{role, content}`` rendered by each policy's own chat template on the node). The split
and the prompt id are derived from the prompt's content (:func:`~astraflow.tasks.base.problem_key`),
so the same row is the same problem, in the same split, in every component and in every copy of
the file (local, in the bucket, converted from JSONL to Parquet).

Files are read with pyarrow: JSON lines (``.gz`` / ``.bz2`` / ``.zst`` decompressed by extension)
and Parquet. A bucket object is downloaded through :class:`~astraflow.objstore.ObjectStore` with the
cluster's credentials (``ClusterConfig.load().resolve()``: ``ASTRAFLOW_S3_*`` or the embedded stack).
Local files are checked when the recipe loads (:meth:`FileDatasetConfig.localized`); a bucket object
is read, and checked the same way, when the dataset is built.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from astraflow.tasks.base import (
    DatasetConfig,
    ListedDataset,
    Problem,
    problem_key,
    prompt_id_of,
    register_dataset,
    split_problems,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from astraflow.config import ClusterConfig

FileFormat = Literal["jsonl", "parquet"]
JSON_BLOCK_BYTES = 64 * 1024 * 1024
"""pyarrow's JSON reader cannot parse a line longer than its block (1 MiB by default): long chats
and documents fit in this one."""


class FieldMapping(BaseModel):
    """Which column of the file holds each part of a problem."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    """Column holding the prompt text (sent as one user message). Defaults to ``prompt`` when
    ``messages`` is not mapped; with ``messages`` mapped too it is only the problem's display text."""
    answer: str = "answer"
    """Column holding the reference answer the reward compares against (numbers become text)."""
    messages: str | None = None
    """Column holding a chat prompt: a list of ``{role, content}``, rendered with each policy's chat
    template. ``None``: the prompt is text."""
    task_type: str | None = None
    """Column holding each row's task type (routing and mixing key on it); ``None``: the dataset
    section's ``task_type`` for every row."""
    metadata: list[str] = Field(default_factory=list)
    """Columns copied, as text, into each task's metadata (difficulty, source, ...)."""

    @model_validator(mode="after")
    def _default_prompt(self) -> FieldMapping:
        if self.prompt is None and self.messages is None:
            self.prompt = "prompt"
        return self

    def columns(self) -> dict[str, str]:
        """Mapped field (``answer``, ``metadata[0]``, ...) -> column name, for every mapped field."""
        named = {f: getattr(self, f) for f in ("prompt", "messages", "answer", "task_type")}
        out = {f: c for f, c in named.items() if c is not None}
        out.update({f"metadata[{i}]": c for i, c in enumerate(self.metadata)})
        return out


class FileDatasetConfig(DatasetConfig):
    """Options of a dataset read from a file."""

    path: str
    """The file: a local path (relative to the recipe file if it exists there, else to the working
    dir) or ``s3://bucket/key``."""
    fields: FieldMapping = Field(default_factory=FieldMapping)
    """Which columns hold the prompt (or chat messages), the answer, the task type and metadata."""
    answer_pattern: str | None = None
    """Regular expression applied to the answer column: the answer is its first group (the whole
    match without groups). E.g. ``'####\\s*(.+)$'`` keeps the final answer of a GSM8K solution.
    A row it does not match is refused."""

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return pattern

    def file_format(self) -> FileFormat:
        return "parquet" if self.type == "parquet" else "jsonl"

    def localized(self, base: Path | None) -> FileDatasetConfig:
        """The options with a local ``path`` made absolute (against ``base`` when the file is
        there, else the working dir), the file read and every row checked against ``fields``, and
        both splits non-empty. A bucket path is only checked for its shape here (no cluster need
        be up when a recipe loads); it is read and checked when the dataset is built."""
        if is_s3(self.path):
            s3_location(self.path)
            return self
        out = self.model_copy(update={"path": str(local_file(self.path, base))})
        check_splits(out, read_problems(out))
        return out


class FileDataset(ListedDataset):
    """Problems from the rows of a file (see the module docstring)."""

    Config = FileDatasetConfig
    config: FileDatasetConfig

    def _load(self) -> list[Problem]:
        return read_problems(self.config)


@register_dataset("jsonl")
class JsonlDataset(FileDataset):
    """Rows of a JSON-lines file (one JSON object per line)."""

    class Config(FileDatasetConfig):
        type: Literal["jsonl"] = "jsonl"


@register_dataset("parquet")
class ParquetDataset(FileDataset):
    """Rows of a Parquet file."""

    class Config(FileDatasetConfig):
        type: Literal["parquet"] = "parquet"


# -- reading -------------------------------------------------------------------------------------
def is_s3(path: str) -> bool:
    return path.startswith("s3://")


def s3_location(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key); ValueError naming ``path`` when it is not one."""
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"path: expected s3://bucket/key of one object, got {url!r}")
    return bucket, key


def local_file(path: str, base: Path | None) -> Path:
    """``path`` as an absolute path: against ``base`` when the file is there, else the working dir."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [*([base / p] if base is not None else []), Path.cwd() / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    where = " and ".join(dict.fromkeys(str(c.resolve()) for c in candidates))
    raise ValueError(f"path: file {path!r} not found (looked for {where})")


def read_table(path: str | Path, file_format: FileFormat, *, cluster: ClusterConfig | None = None) -> pa.Table:
    """The file's rows as an Arrow table; a bucket object is downloaded first (see
    :func:`download`). ValueError names the path when the file cannot be read."""
    if isinstance(path, str) and is_s3(path):
        with tempfile.TemporaryDirectory(prefix="astraflow-data-") as tmp:
            return read_table(download(path, Path(tmp), cluster=cluster), file_format)
    import pyarrow as pa
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    try:
        if file_format == "parquet":
            return pq.read_table(path)
        return pj.read_json(path, read_options=pj.ReadOptions(block_size=JSON_BLOCK_BYTES))
    except FileNotFoundError:
        raise ValueError(f"path: file {str(path)!r} not found") from None
    except (pa.ArrowException, OSError, ValueError) as exc:  # pyarrow's carry the row and column
        what = "Parquet" if file_format == "parquet" else "JSON lines (one object per line)"
        raise ValueError(f"path: cannot read {path} as {what}: {exc}") from None


def download(url: str, folder: Path, *, cluster: ClusterConfig | None = None) -> Path:
    """The object at ``s3://bucket/key`` as a file in ``folder`` (same file name, so compression is
    still recognised by extension). Objects written through :class:`ObjectStore` are checked against
    their sha256; objects uploaded by other tools carry none and are taken as they are."""
    from astraflow.config import ClusterConfig
    from astraflow.objstore import ObjectStore
    from astraflow.objstore.errors import ObjectNotFoundError

    bucket, key = s3_location(url)
    cfg = (cluster or ClusterConfig.load()).resolve()
    cfg = cfg.model_copy(update={"s3": cfg.s3.model_copy(update={"bucket": bucket})})
    store = ObjectStore.from_config(cfg)
    try:
        head = store.head(key)
    except ObjectNotFoundError:
        raise ValueError(f"path: no object {url} on {store.endpoint}") from None
    out = folder / Path(key).name
    store.get_file(key, out, verify=head["sha256"] is not None)
    return out


def read_problems(config: FileDatasetConfig, *, cluster: ClusterConfig | None = None) -> list[Problem]:
    """Every row of the configured file as a problem; ValueError naming the field, the column, the
    row and the path when a mapped column is missing or a value has the wrong shape."""
    table = read_table(config.path, config.file_format(), cluster=cluster)
    fields = config.fields
    have = table.column_names
    for field, column in fields.columns().items():
        if column not in have:
            raise ValueError(f"fields.{field}: column {column!r} not in {config.path} "
                             f"(columns: {', '.join(have)})")
    if table.num_rows == 0:
        raise ValueError(f"path: {config.path} has no rows")
    pattern = re.compile(config.answer_pattern) if config.answer_pattern else None
    stem = _stem(config.path)
    rows = table.select(sorted(set(fields.columns().values()))).to_pylist()
    return [_problem(row, i + 1, fields, pattern, stem, config.path) for i, row in enumerate(rows)]


def check_splits(config: FileDatasetConfig, problems: list[Problem]) -> None:
    """Refuse a file whose train split is empty, or whose held-out split is empty although a
    held-out share was asked for (evaluation would score nothing)."""
    splits = split_problems(problems, config.heldout_fraction)
    n = len(splits["train"]) + len(splits["heldout"])
    if not splits["train"]:
        raise ValueError(f"heldout_fraction: all {n} distinct prompts of {config.path} fell in the "
                         f"held-out split (heldout_fraction {config.heldout_fraction}); none is left to train on")
    if config.heldout_fraction > 0 and not splits["heldout"]:
        raise ValueError(f"heldout_fraction: none of the {n} distinct prompts of {config.path} fell in the "
                         f"held-out split (heldout_fraction {config.heldout_fraction}); add rows, raise "
                         "heldout_fraction, or set it to 0 to train on every row")


def _stem(path: str) -> str:
    """The file's name without its extensions: the prefix of its prompt ids."""
    name = path.rsplit("/", 1)[-1]
    return name.split(".", 1)[0] or "file"


def _problem(row: dict[str, Any], n: int, fields: FieldMapping, pattern: re.Pattern[str] | None,
             stem: str, path: str) -> Problem:
    def bad(field: str, expected: str) -> ValueError:
        column = fields.columns()[field]
        return ValueError(f"fields.{field}: row {n} of {path}: column {column!r} holds "
                          f"{_short(row[column])}, expected {expected}")

    messages: tuple[tuple[str, str], ...] = ()
    if fields.messages is not None:
        messages = _messages(row[fields.messages])
        if not messages:
            raise bad("messages", "a non-empty list of {role, content} with text values")
    prompt = ""
    if fields.prompt is not None:
        prompt = row[fields.prompt]
        if not isinstance(prompt, str) or not prompt.strip():
            raise bad("prompt", "non-empty text")
    elif messages:
        prompt = next((c for r, c in reversed(messages) if r == "user"), messages[-1][1])
    answer = _text(row[fields.answer])
    if answer is None or not answer.strip():
        raise bad("answer", "a non-empty value")
    if pattern is not None:
        m = pattern.search(answer)
        if m is None:
            raise bad("answer", f"a match of answer_pattern {pattern.pattern!r}")
        answer = (m.group(1) if pattern.groups else m.group(0)).strip()
    task_type = ""
    if fields.task_type is not None:
        task_type = _text(row[fields.task_type]) or ""
    metadata = {c: t for c in fields.metadata if (t := _text(row[c])) is not None}
    problem = Problem(prompt_id="", prompt=prompt, answer=answer, task_type=task_type,
                      messages=messages, metadata=metadata)
    return dataclasses.replace(problem, prompt_id=prompt_id_of(stem, problem_key(problem)))


def _messages(value: Any) -> tuple[tuple[str, str], ...]:
    """A chat as (role, content) pairs; () when ``value`` is not a list of {role, content} texts."""
    if not isinstance(value, list):
        return ()
    out = []
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return ()
        out.append((m["role"], m["content"]))
    return tuple(out)


def _text(value: Any) -> str | None:
    """A cell as text: numbers without a spurious ``.0`` (JSON readers widen ``3`` to ``3.0`` when a
    column mixes integers and decimals), lists and mappings as JSON, null as None."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
