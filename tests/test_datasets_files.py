"""Datasets from files (JSONL, Parquet, local and s3://) and the gsm_symbolic generator: field
mapping, deterministic disjoint splits, content-derived ids, and errors naming the field and path."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq
import pytest
import yaml

from astraflow.config import ClusterConfig, ConfigError
from astraflow.recipe import Recipe
from astraflow.recipe.data import recipe_dataset, task_of
from astraflow.tasks import build_dataset
from astraflow.tasks.base import DATASETS, ListedDataset, problem_key, split_of
from astraflow.tasks.files import FileDatasetConfig, read_problems
from astraflow.workflows.rewards import extract_hash_answer

ROOT = Path(__file__).parent.parent
WORDS = ROOT / "examples" / "data" / "word_problems.jsonl"
CHATS = ROOT / "examples" / "data" / "chat_problems.jsonl"
WORD_FIELDS = {"prompt": "question", "answer": "answer", "metadata": ["difficulty"]}


def _words(**options) -> ListedDataset:
    return build_dataset({"type": "jsonl", "path": str(WORDS), "fields": WORD_FIELDS, **options})


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tmp_path: Path, dataset: dict, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"policies": [{"name": "policy", "model": str(ROOT / "examples/models/tiny.yaml")}],
                                    "dataset": dataset, "workflow": {"type": "math", "reward": "last_number"}}))
    return path


def _load_error(tmp_path: Path, dataset: dict) -> str:
    with pytest.raises(ConfigError) as exc:
        Recipe.load(_recipe(tmp_path, dataset))
    return str(exc.value)


# -- the shipped example files -------------------------------------------------------------------
def test_jsonl_rows_become_problems() -> None:
    ds = _words()
    rows = [json.loads(line) for line in WORDS.read_text().splitlines()]
    problems = ds.all_problems("train") + ds.all_problems("heldout")
    assert len(rows) >= 40 and len(problems) == len(rows)
    by_prompt = {p.prompt: p for p in problems}
    for row in rows:
        p = by_prompt[row["question"]]
        assert p.answer == str(row["answer"]) and p.answer.isdigit()
        assert p.metadata == {"difficulty": row["difficulty"]}
        assert p.messages == () and p.task_type == ""
        assert p.prompt_id.startswith("word_problems-")
    assert len({p.prompt_id for p in problems}) == len(problems)


def test_shipped_recipe_loads_with_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the data path is relative to the recipe file, not the working dir
    recipe = Recipe.load(ROOT / "examples" / "recipes" / "jsonl_math.yaml")
    assert recipe.dataset.type == "jsonl" and Path(recipe.dataset.path) == WORDS.resolve()
    assert recipe.workflow.reward.type == "last_number"
    ds = recipe_dataset(recipe)
    assert ds.all_problems("train") and ds.all_problems("heldout")
    task = task_of(ds.all_problems("heldout")[0], recipe)
    assert task.task_type == "math" and task.metadata["difficulty"] in {"easy", "medium", "hard"}
    # A recipe travels between processes as its dump: the dataset section survives the round trip.
    again = Recipe.model_validate(recipe.model_dump())
    assert again.dataset == recipe.dataset


def test_chat_messages_file() -> None:
    ds = build_dataset({"type": "jsonl", "path": str(CHATS), "heldout_fraction": 0.3,
                        "fields": {"messages": "messages", "answer": "answer", "task_type": "topic"}})
    problems = ds.all_problems("train") + ds.all_problems("heldout")
    rows = [json.loads(line) for line in CHATS.read_text().splitlines()]
    assert len(problems) == len(rows)
    for p in problems:
        row = next(r for r in rows if tuple((m["role"], m["content"]) for m in r["messages"]) == p.messages)
        assert p.prompt == row["messages"][-1]["content"]  # display text: the last user message
        assert p.answer == str(row["answer"]) and p.task_type == row["topic"]
        assert split_of(problem_key(p), 0.3) in ("train", "heldout")
    # The chat reaches the node as JSON in the task's metadata, rendered there by the policy's template.
    recipe = Recipe.model_validate({"policies": [{"name": "policy"}],
                                    "dataset": {"type": "jsonl", "path": str(CHATS),
                                                "fields": {"messages": "messages"}}})
    task = task_of(problems[0], recipe)
    assert json.loads(task.metadata["messages"]) == [{"role": r, "content": c} for r, c in problems[0].messages]
    assert task.task_type == problems[0].task_type


def test_parquet_matches_jsonl(tmp_path: Path) -> None:
    parquet = tmp_path / "word_problems.parquet"
    pq.write_table(pj.read_json(WORDS), parquet)
    a = _words()
    b = build_dataset({"type": "parquet", "path": str(parquet), "fields": WORD_FIELDS})
    for split in ("train", "heldout"):
        assert a.all_problems(split) == b.all_problems(split)  # same ids, prompts, answers, same split
        assert [p.metadata for p in a.all_problems(split)] == [p.metadata for p in b.all_problems(split)]


def test_compressed_jsonl(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "word_problems.jsonl.gz"
    path.write_bytes(gzip.compress(WORDS.read_bytes()))
    ds = build_dataset({"type": "jsonl", "path": str(path), "fields": WORD_FIELDS})
    assert ds.all_problems("train") == _words().all_problems("train")


def test_parquet_chat_messages_and_numbers(tmp_path: Path) -> None:
    path = tmp_path / "chats.parquet"
    table = pa.table({
        "conversation": [[{"role": "user", "content": f"What is {i} plus {i}?"}] for i in range(30)],
        "solution": [float(2 * i) for i in range(30)],   # integral floats read back as integers
        "level": list(range(30)),
    })
    pq.write_table(table, path)
    ds = build_dataset({"type": "parquet", "path": str(path), "heldout_fraction": 0.2,
                        "fields": {"messages": "conversation", "answer": "solution", "metadata": ["level"]}})
    problems = ds.all_problems("train") + ds.all_problems("heldout")
    assert sorted(int(p.answer) for p in problems) == [2 * i for i in range(30)]
    assert all(p.answer == str(2 * int(p.metadata["level"])) for p in problems)


def test_answer_pattern_extracts_the_final_answer(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "gsm.jsonl", [
        {"question": f"q{i}", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"} for i in range(1000, 1030)])
    ds = build_dataset({"type": "jsonl", "path": str(path), "answer_pattern": r"####\s*(.+)$", "fields": {"prompt": "question"},
                        "heldout_fraction": 0.2})
    problems = ds.all_problems("train") + ds.all_problems("heldout")
    assert {p.answer for p in problems} == {f"{2 * i:,}" for i in range(1000, 1030)}


# -- splits, subsets, streams -------------------------------------------------------------------
def test_split_is_deterministic_and_disjoint() -> None:
    a, b = _words(seed=1), _words(seed=2)
    train, heldout = a.all_problems("train"), a.all_problems("heldout")
    assert train and heldout
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}
    # The split depends on the prompt only: another seed (or process) draws the same split.
    assert b.all_problems("train") == train and b.all_problems("heldout") == heldout
    assert all(split_of(p.prompt, 0.1) == "heldout" for p in heldout)


def test_problems_is_a_seeded_subset() -> None:
    ds = _words()
    train = ds.all_problems("train")
    first = ds.problems("train", 10, seed=3)
    assert len(first) == 10 and len(set(first)) == 10 and set(first) <= set(train)
    assert _words().problems("train", 10, seed=3) == first
    assert ds.problems("train", 10, seed=4) != first
    assert len(ds.problems("heldout", 1000)) == len(ds.all_problems("heldout"))  # fewer when the split has fewer


def test_stream_cycles_over_train_in_seeded_orders() -> None:
    ds = _words()
    train = ds.all_problems("train")
    n = len(train)
    drawn = list(itertools.islice(ds.stream("train", seed=5), 3 * n))
    for k in range(3):  # every pass is a permutation of the train split
        assert sorted(p.prompt_id for p in drawn[k * n:(k + 1) * n]) == sorted(p.prompt_id for p in train)
    assert drawn[:n] != drawn[n:2 * n]  # a fresh order each pass
    assert list(itertools.islice(_words().stream("train", seed=5), 3 * n)) == drawn
    assert list(itertools.islice(ds.stream("train", seed=6), n)) != drawn[:n]


def test_repeated_prompts_are_one_problem(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i % 20}", "answer": i % 20} for i in range(60)]
    ds = build_dataset({"type": "jsonl", "path": str(_write_jsonl(tmp_path / "dup.jsonl", rows))})
    assert len(ds.all_problems("train")) + len(ds.all_problems("heldout")) == 20


def test_relative_path_resolves_against_recipe_then_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipes, data, elsewhere = tmp_path / "recipes", tmp_path / "data", tmp_path / "cwd"
    for d in (recipes, data, elsewhere):
        d.mkdir()
    (data / "w.jsonl").write_bytes(WORDS.read_bytes())
    monkeypatch.chdir(elsewhere)
    recipe = Recipe.load(_recipe(recipes, {"type": "jsonl", "path": "../data/w.jsonl", "fields": WORD_FIELDS}))
    assert Path(recipe.dataset.path) == (data / "w.jsonl").resolve()
    (elsewhere / "only_here.jsonl").write_bytes(WORDS.read_bytes())
    recipe = Recipe.load(_recipe(recipes, {"type": "jsonl", "path": "only_here.jsonl", "fields": WORD_FIELDS}))
    assert Path(recipe.dataset.path) == (elsewhere / "only_here.jsonl").resolve()


# -- refused at recipe load, naming the field and the path ---------------------------------------
def test_missing_file_is_named(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, {"type": "jsonl", "path": "nope/missing.jsonl"})
    assert "dataset" in msg and "path" in msg and "missing.jsonl" in msg and "not found" in msg


def test_unmapped_column_is_named(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(WORDS),
                                 "fields": {"prompt": "question", "answer": "solution"}})
    assert "fields.answer: column 'solution' not in" in msg and "word_problems.jsonl" in msg
    assert "(columns: question, answer, difficulty)" in msg
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(WORDS), "fields": {"prompt": "question",
                                                                                  "metadata": ["difficulty", "level"]}})
    assert "fields.metadata[1]: column 'level'" in msg
    # The default prompt column is "prompt": a file without one is refused the same way.
    assert "fields.prompt: column 'prompt'" in _load_error(tmp_path, {"type": "jsonl", "path": str(WORDS)})


def test_misspelt_mapping_key_is_named(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(WORDS), "fields": {"promt": "question"}})
    assert "dataset" in msg and "fields.promt" in msg


def test_bad_values_name_the_row(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "answer": i} for i in range(30)]
    rows[6]["prompt"] = None
    path = _write_jsonl(tmp_path / "holes.jsonl", rows)
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(path)})
    assert "fields.prompt: row 7 of" in msg and "holes.jsonl" in msg and "'prompt'" in msg
    rows[6]["prompt"], rows[3]["answer"] = "p6", None
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(_write_jsonl(path, rows))})
    assert "fields.answer: row 4 of" in msg
    bad_chat = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": "hello", "answer": 1}])
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(bad_chat), "fields": {"messages": "messages"}})
    assert "fields.messages: row 1 of" in msg and "role, content" in msg


def test_answer_pattern_errors(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(WORDS), "answer_pattern": "(unclosed"})
    assert "answer_pattern" in msg and "not a regular expression" in msg
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(WORDS), "fields": WORD_FIELDS,
                                 "answer_pattern": r"####\s*(.+)"})
    assert "fields.answer: row 1 of" in msg and "answer_pattern" in msg


def test_unreadable_and_empty_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": \n')
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(broken)})
    assert "path: cannot read" in msg and "broken.jsonl" in msg
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    assert "as Parquet" in _load_error(tmp_path, {"type": "parquet", "path": str(not_parquet)})
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    assert "has no rows" in _load_error(tmp_path, {"type": "parquet", "path": str(empty)})


def test_empty_split_is_refused(tmp_path: Path) -> None:
    prompts = [p for p in (f"p{i}" for i in range(100)) if split_of(p, 0.1) == "train"][:3]
    path = _write_jsonl(tmp_path / "three.jsonl", [{"prompt": p, "answer": 1} for p in prompts])
    msg = _load_error(tmp_path, {"type": "jsonl", "path": str(path), "heldout_fraction": 0.1})
    assert "heldout_fraction" in msg and "three.jsonl" in msg and "held-out split" in msg
    Recipe.load(_recipe(tmp_path, {"type": "jsonl", "path": str(path), "heldout_fraction": 0.0}))  # train on all


def test_s3_url_shape_checked_at_load(tmp_path: Path) -> None:
    assert "s3://bucket/key" in _load_error(tmp_path, {"type": "jsonl", "path": "s3://only-bucket"})


# -- s3:// through the real object store -----------------------------------------------------------
@pytest.fixture
def s3_env(test_cluster: ClusterConfig, monkeypatch: pytest.MonkeyPatch) -> ClusterConfig:
    """The process environment pointing at the test cluster, as a deployment would set it."""
    monkeypatch.delenv("ASTRAFLOW_CONFIG", raising=False)
    s3 = test_cluster.s3
    for name, value in {"KAFKA_BOOTSTRAP": test_cluster.kafka.bootstrap, "S3_ENDPOINT": s3.endpoint,
                        "S3_ACCESS_KEY": s3.access_key, "S3_SECRET_KEY": s3.secret_key,
                        "S3_REGION": s3.region, "S3_BUCKET": "some-other-bucket"}.items():
        monkeypatch.setenv(f"ASTRAFLOW_{name}", value)
    return test_cluster


@pytest.mark.integration
def test_s3_jsonl_and_parquet(s3_env: ClusterConfig, tmp_path: Path) -> None:
    from astraflow.objstore import ObjectStore

    store = ObjectStore.from_config(s3_env)
    bucket, run = s3_env.s3.bucket, s3_env.run
    store.put_file(f"{run}/data/word_problems.jsonl", WORDS)  # carries the store's sha256
    parquet = tmp_path / "w.parquet"
    pq.write_table(pj.read_json(WORDS), parquet)
    # uploaded by another tool: no sha256 in its metadata, still readable
    store.client.put_object(Bucket=bucket, Key=f"{run}/data/word_problems.parquet", Body=parquet.read_bytes())
    local = _words()
    for kind, ext in (("jsonl", "jsonl"), ("parquet", "parquet")):
        url = f"s3://{bucket}/{run}/data/word_problems.{ext}"
        recipe = Recipe.load(_recipe(tmp_path, {"type": kind, "path": url, "fields": WORD_FIELDS}))
        assert recipe.dataset.path == url
        ds = recipe_dataset(recipe)
        for split in ("train", "heldout"):
            assert ds.all_problems(split) == local.all_problems(split)


@pytest.mark.integration
def test_s3_errors_name_the_object(s3_env: ClusterConfig) -> None:
    from astraflow.objstore import ObjectStore

    url = f"s3://{s3_env.s3.bucket}/{s3_env.run}/data/missing.jsonl"
    with pytest.raises(ValueError, match=r"path: no object s3://.*missing\.jsonl"):
        build_dataset({"type": "jsonl", "path": url}).all_problems("train")
    key = f"{s3_env.run}/data/w.jsonl"
    ObjectStore.from_config(s3_env).put_file(key, WORDS)
    config = FileDatasetConfig.model_validate({"type": "jsonl", "path": f"s3://{s3_env.s3.bucket}/{key}",
                                               "fields": {"answer": "solution"}})
    with pytest.raises(ValueError, match=r"fields.prompt: column 'prompt' not in s3://"):
        read_problems(config)


# -- gsm_symbolic (reasoning-gym) -------------------------------------------------------------------
def test_gsm_symbolic_is_deterministic_per_seed() -> None:
    pytest.importorskip("reasoning_gym")
    a = build_dataset({"type": "gsm_symbolic", "size": 120, "seed": 7})
    b = build_dataset({"type": "gsm_symbolic", "size": 120, "seed": 7})
    c = build_dataset({"type": "gsm_symbolic", "size": 120, "seed": 8})
    assert a.all_problems("train") == b.all_problems("train") and a.all_problems("heldout") == b.all_problems("heldout")
    assert a.problems("train", 20, seed=1) == b.problems("train", 20, seed=1)
    assert {p.prompt for p in a.all_problems("train")} != {p.prompt for p in c.all_problems("train")}
    problems = a.all_problems("train") + a.all_problems("heldout")
    assert len(problems) > 100 and not {p.prompt for p in a.all_problems("train")} & {p.prompt for p in a.all_problems("heldout")}
    for p in problems:
        assert str(int(p.answer)) == p.answer and p.prompt_id.startswith("gsm_symbolic-")
        assert float(extract_hash_answer(p.metadata["solution"])) == int(p.answer)  # "#### 36.0" for 36


def test_gsm_symbolic_rewards_its_own_solutions() -> None:
    pytest.importorskip("reasoning_gym")
    from astraflow.records import Task
    from astraflow.workflows.rewards import build_reward

    ds = build_dataset({"type": "gsm_symbolic", "size": 30, "seed": 0})
    hash_answer, last_number = build_reward("hash_answer"), build_reward("last_number")
    for p in ds.all_problems("train"):
        task = Task(prompt_id=p.prompt_id, prompt=p.prompt, answer=p.answer)
        assert hash_answer(p.metadata["solution"], task) == 1.0
        assert last_number(p.metadata["solution"], task) == 1.0


def test_gsm_symbolic_recipe_refused_without_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    msg = _load_error(tmp_path, {"type": "gsm_symbolic"})
    assert "reasoning-gym" in msg and "pip install" in msg


def test_file_datasets_are_registered() -> None:
    assert {"jsonl", "parquet", "gsm_symbolic"} <= set(DATASETS.names())


def test_docs_plugin_example_works_through_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dataset and reward plug-ins written out in docs/datasets.md, named by a recipe's imports."""
    import re

    from astraflow.records import Task
    from astraflow.workflows.rewards import build_reward

    doc = (ROOT / "docs" / "datasets.md").read_text()
    code = re.search(r"```python\n(# my_plugins\.py.*?)```", doc, re.DOTALL).group(1)
    recipe_yaml = re.search(r"```yaml\n(imports: \[my_plugins\].*?)```", doc, re.DOTALL).group(1)
    (tmp_path / "my_plugins.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = {**yaml.safe_load(recipe_yaml), "policies": [{"name": "policy", "model": str(ROOT / "examples/models/tiny.yaml")}]}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = Recipe.load(path)
    ds = recipe_dataset(recipe)
    assert len(ds.all_problems("train")) + len(ds.all_problems("heldout")) == 400
    reward = build_reward(recipe.workflow.reward)
    assert reward("about 102", Task(prompt_id="p", prompt="q", answer="100")) == 1.0
    assert reward("about 106", Task(prompt_id="p", prompt="q", answer="100")) == 0.0
