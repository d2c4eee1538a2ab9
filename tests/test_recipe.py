"""Recipe validation: every shipped recipe validates; bad ones fail with a message naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astraflow.config import ConfigError
from astraflow.recipe import Recipe

ALL_RECIPES = sorted((Path(__file__).parent.parent / "examples" / "recipes").glob("*.yaml"))
NEEDS_VLLM = {"smollm2_word_calc_vllm_cuda.yaml"}
"""Recipes whose engine is vLLM: they validate only where vLLM is installed (tests/test_vllm_compat.py)."""
RECIPES = [p for p in ALL_RECIPES if p.name not in NEEDS_VLLM]
MINIMAL = {"policies": [{"name": "policy"}]}


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(path: Path) -> None:
    recipe = Recipe.load(path)
    assert recipe.policies
    for policy in recipe.policies:
        if "://" not in policy.model and not policy.model.startswith("gguf:"):
            assert Path(policy.model).is_absolute() and Path(policy.model).exists(), policy.model
    assert set(recipe.dataflow.policies) == {p.name for p in recipe.policies}


def test_shipped_recipes_exist() -> None:
    names = {p.stem for p in RECIPES}
    assert {"math", "solver_verifier"} <= names
    assert NEEDS_VLLM <= {p.name for p in ALL_RECIPES}


@pytest.mark.parametrize("name", sorted(NEEDS_VLLM))
def test_a_vllm_recipe_without_vllm_is_refused_naming_the_package(name: str) -> None:
    from connectors.vllm.config import vllm_available

    if vllm_available():
        pytest.skip("vLLM is installed here: tests/test_vllm_compat.py validates the recipe")
    with pytest.raises(ConfigError, match=r"pools\.0\.engine.*needs the vllm package"):
        Recipe.load(Path(__file__).parent.parent / "examples" / "recipes" / name)


def test_unknown_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        Recipe.load(_write(tmp_path, {**MINIMAL, "trainer": {"stepz": 3}}))
    msg = str(exc.value)
    assert "trainer.stepz" in msg and "Extra inputs are not permitted" in msg
    assert str(tmp_path / "recipe.yaml") in msg


def test_unknown_top_level_section_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rl"):
        Recipe.load(_write(tmp_path, {**MINIMAL, "rl": {"steps": 3}}))


def test_bad_policy_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        Recipe.load(_write(tmp_path, {"policies": [{"name": "Bad.Name"}]}))
    assert "policies.0.name" in str(exc.value)


def test_duplicate_policy_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="policy names must be unique"):
        Recipe.load(_write(tmp_path, {"policies": [{"name": "a"}, {"name": "a"}]}))


def test_dataset_pool_not_in_pools(tmp_path: Path) -> None:
    data = {**MINIMAL, "dataset": {"type": "minmax", "pool": "gpu"}, "pools": [{"name": "cpu"}]}
    with pytest.raises(ConfigError) as exc:
        Recipe.load(_write(tmp_path, data))
    assert "dataset.pool 'gpu' is not one of the pools ['cpu']" in str(exc.value)


def test_sampling_for_unknown_policy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sampling names unknown policies"):
        Recipe.load(_write(tmp_path, {**MINIMAL, "sampling": {"ghost": {}}}))


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="recipe not found"):
        Recipe.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Recipe.load(bad)


def test_launcher_overrides_are_validated(tmp_path: Path) -> None:
    from astraflow.launcher.plan import effective_recipe

    recipe = Recipe.load(RECIPES[0])
    eff = effective_recipe(recipe, run_id="r1", steps=3, nodes={recipe.pools[0].name: 2})
    assert eff.run == "r1" and eff.trainer.steps == 3 and eff.pools[0].nodes == 2
    assert all(Path(p.model).is_absolute() for p in eff.policies)
    with pytest.raises(ValueError, match="unknown pools"):
        effective_recipe(recipe, run_id="r1", nodes={"nope": 1})
    with pytest.raises(ValueError):
        effective_recipe(recipe, run_id="r1", steps=0)


# -- typed seams: plug-in sections are parsed into the named plug-in's options at load ----------
def _refused(tmp_path: Path, data: dict) -> str:
    with pytest.raises(ConfigError) as exc:
        Recipe.load(_write(tmp_path, {**MINIMAL, **data}))
    return str(exc.value)


def test_unknown_workflow_is_refused_listing_the_registered_ones(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"workflow": {"type": "mathz", "policy": "policy"}})
    assert "workflow" in msg and "unknown workflow 'mathz'" in msg and "solver_verifier" in msg


def test_misspelt_workflow_option_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"workflow": {"type": "math", "policy": "policy", "rewrd": "exact_match"}})
    assert "workflow 'math': rewrd: Extra inputs are not permitted" in msg


def test_wrong_option_type_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"dataset": {"type": "minmax", "max_len": "long"}})
    assert "dataset 'minmax': max_len" in msg and "integer" in msg


def test_unknown_reward_inside_a_workflow_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"workflow": {"type": "math", "policy": "policy", "reward": "nope"}})
    assert "unknown reward 'nope'" in msg and "exact_match" in msg


def test_workflow_calling_an_undeclared_policy_is_refused(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"workflow": {"type": "solver_verifier"}})
    assert "calls policies ['solver', 'verifier']" in msg


def test_missing_checkpoint_directory_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"policies": [{"name": "policy", "model": "no/such/checkpoint"}]})
    assert "policies[0].model" in msg and "no/such/checkpoint" in msg


# -- dataflow plug-ins and engine options: refused at load, naming the field -------------------------
def test_misspelt_filter_name_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"dataflow": {"filters": ["keep_all", {"type": "dynamic_samplin"}]}})
    assert "dataflow.filters.1.type: unknown filter plug-in 'dynamic_samplin'" in msg and "dynamic_sampling" in msg


def test_misspelt_filter_option_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"dataflow": {"filters": [{"type": "dynamic_sampling", "options": {"min_std": 0.1}}]}})
    assert "dataflow.filters.0.options.min_std: Extra inputs are not permitted" in msg


def test_wrong_filter_option_type_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"dataflow": {"filters": [{"type": "dynamic_sampling", "options": {"tolerance": "tiny"}}]}})
    assert "dataflow.filters.0.options.tolerance: Input should be a valid number" in msg


def test_misspelt_selector_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"dataflow": {"selector": "gresso"}})
    assert "dataflow.selector.type: unknown selector plug-in 'gresso'" in msg and "'greso'" in msg


def test_misspelt_sampler_option_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"dataflow": {"sampler": {"type": "replay", "options": {"replay_rato": 0.5}}}})
    assert "dataflow.sampler.options.replay_rato: Extra inputs are not permitted" in msg


def test_misspelt_engine_option_is_named(tmp_path: Path) -> None:
    msg = _refused(tmp_path, {"pools": [{"name": "sim", "engine": {"type": "simulated", "tokens_per_sec": 100}}],
                              "dataset": {"type": "minmax", "pool": "sim"}})
    assert "pools.0.engine: engine 'simulated': tokens_per_sec: Extra inputs are not permitted" in msg
    msg = _refused(tmp_path, {"pools": [{"engine": {"max_batchsize": 4}}]})  # no type: the built-in hf engine
    assert "pools.0.engine: engine 'hf': max_batchsize: Extra inputs are not permitted" in msg


def test_dataflow_builds_its_plugins_from_the_options_parsed_at_load(tmp_path: Path) -> None:
    from astraflow.dataflow import Dataflow

    recipe = Recipe.load(_write(tmp_path, {**MINIMAL, "dataflow": {
        "selector": {"type": "greso", "options": {"explore_prob": 0.5}}, "filters": ["dynamic_sampling"],
        "sampler": {"type": "replay", "options": {"capacity": 7}}}}))
    section = recipe.dataflow
    df = Dataflow(section, [])
    assert df.emitter.selector.options is section.selector.options and section.selector.options.explore_prob == 0.5
    assert df.processor.filters[0].options is section.filters[0].options
    assert df.batchers["policy"].sampler.options is section.sampler.options and section.sampler.options.capacity == 7
    # the dumped recipe (what the launcher hands its components) keeps every option
    again = Recipe.model_validate(recipe.model_dump(mode="json")).dataflow
    assert again.selector.options == section.selector.options and again.sampler.options.capacity == 7


def test_user_plugin_module_is_imported_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "recipe_seam_test_plugins.py").write_text(
        "from typing import Literal\n"
        "from astraflow.workflows import Reward, register_reward\n"
        "from astraflow.workflows.rewards import RewardConfig\n"
        "@register_reward('always_one_test')\n"
        "class AlwaysOne(Reward):\n"
        "    class Config(RewardConfig):\n"
        "        type: Literal['always_one_test'] = 'always_one_test'\n"
        "        value: float = 1.0\n"
        "    def __call__(self, response, task):\n"
        "        return self.config.value\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = Recipe.load(_write(tmp_path, {**MINIMAL, "imports": ["recipe_seam_test_plugins"], "workflow": {
        "type": "math", "policy": "policy", "reward": {"type": "always_one_test", "value": 0.5}}}))
    assert recipe.workflow.reward.value == 0.5
    # the dumped recipe (what the launcher hands its components) keeps every option
    dumped = recipe.model_dump(mode="json")
    assert dumped["workflow"]["reward"] == {"type": "always_one_test", "value": 0.5}
    assert Recipe.model_validate(dumped).workflow.reward.value == 0.5
    msg = _refused(tmp_path, {"imports": ["no_such_plugin_module"]})
    assert "cannot import plug-in module 'no_such_plugin_module'" in msg


def test_recipe_tasks_name_the_problem_they_were_drawn_from() -> None:
    """Each draw of the endless stream is its own task (``<problem>.<draw>``), but per-prompt plug-in
    statistics (GRESO's history) key on the problem: bounded by the dataset, not by the run's age."""
    from itertools import islice

    from astraflow.dataflow.plugins.selectors import source_id
    from astraflow.recipe.data import recipe_tasks

    recipe = Recipe.load(Path(__file__).parent.parent / "examples" / "recipes" / "math.yaml")
    tasks = list(islice(recipe_tasks(recipe), 300))
    assert len({t.prompt_id for t in tasks}) == 300
    assert all(source_id(t) == t.prompt_id.rsplit(".", 1)[0] for t in tasks)
