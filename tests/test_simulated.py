"""The simulated engine and trainer backend (no broker): timing, length distribution, versions."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import pytest
import yaml

from astraflow.config import ConfigError
from astraflow.engines import FullState, SamplingParams, SimulatedEngineConfig, build_engine
from astraflow.recipe import Recipe
from astraflow.trainer.backend import build_backend
from astraflow.trainer.config import SimulatedBackendConfig

SIM_RECIPES = ["sim_single", "sim_hetero", "sim_solver_verifier"]


def test_length_distribution_matches_the_stated_quantiles():
    cfg = SimulatedEngineConfig(median_tokens=48, sigma=1.0, max_tokens=100_000)
    rng = random.Random(0)
    xs = sorted(cfg.draw_length(rng) for _ in range(20_000))
    assert abs(xs[len(xs) // 2] - 48) <= 2
    assert 0.85 < xs[int(0.99 * len(xs))] / cfg.quantile(0.99) < 1.15
    assert abs(cfg.quantile(0.99) - 48 * 10.24) < 1


def test_continuous_batching_time_follows_the_longest_sequence_and_versions_change_mid_sequence():
    eng = build_engine({"type": "simulated", "tokens_per_s": 400, "median_tokens": 200, "sigma": 0.0,
                        "max_tokens": 200}, None)
    params = SamplingParams(max_new_tokens=1000)

    async def run():
        t0 = time.monotonic()
        swap = threading.Timer(0.25, lambda: eng.update_weights(FullState({"w": 1}, 7)))
        swap.start()
        outs = await asyncio.gather(*[eng.agenerate([[1]] * 4, params) for _ in range(8)])
        return time.monotonic() - t0, [g for o in outs for g in o]

    secs, gens = asyncio.run(run())
    assert 0.4 < secs < 1.5  # 32 sequences of 200 tokens at 400 tok/s each, decoded together
    assert all(len(g.token_ids) == 200 and g.finish_reason == "stop" and g.token_ids[-1] == 2 for g in gens)
    assert all(g.versions[0] == 0 and g.versions[-1] == 7 for g in gens)  # swapped mid-sequence


def test_cap_and_strict_weight_names():
    eng = build_engine({"type": "simulated", "tokens_per_s": 5000, "median_tokens": 50}, None)
    (g,) = eng.generate([[1]], SamplingParams(max_new_tokens=3))
    assert len(g.token_ids) <= 3
    eng.update_weights(FullState({"a": 1}, 1))
    try:
        eng.update_weights(FullState({"b": 1}, 2))
    except ValueError as exc:
        assert "tensor names changed" in str(exc)
    else:
        raise AssertionError("a changed tensor set must be refused")


def test_simulated_backend_step_time_scales_with_tokens_and_weights_change():
    class T:
        def __init__(self, n):
            self.loss_mask, self.reward = [1] * n, 0.0

    be = build_backend(None, {"type": "simulated", "step_base_s": 0.0, "step_s_per_token": 1e-3, "params": 1000})
    w0 = be.state_dict()["simulated.weight"]
    t0 = time.perf_counter()
    be.step([T(100)])
    short = time.perf_counter() - t0
    t0 = time.perf_counter()
    be.step([T(300)])
    long = time.perf_counter() - t0
    assert 0.09 < short < 0.25 and 0.29 < long < 0.5
    assert (be.state_dict()["simulated.weight"] != w0).sum() > 0


def test_same_seed_same_lengths_and_the_seed_is_the_engines_own():
    params = SamplingParams(max_new_tokens=10_000)
    lengths = []
    for seed in (3, 3, 4):
        eng = build_engine({"type": "simulated", "seed": seed, "tokens_per_s": 1e6, "tick_s": 0.001}, None)
        lengths.append([len(g.token_ids) for g in eng.generate([[1]] * 8, params)])
    assert lengths[0] == lengths[1] != lengths[2]


@pytest.mark.parametrize("name", SIM_RECIPES)
def test_simulation_recipes_load_with_flat_engine_and_backend_sections(name):
    recipe = Recipe.load(f"examples/recipes/{name}.yaml")
    assert all(isinstance(p.engine, SimulatedEngineConfig) and p.engine.tokens_per_s == 250 for p in recipe.pools)
    assert all(isinstance(p.backend, SimulatedBackendConfig) and p.backend.step_base_s == 0.25
               for p in recipe.policies)
    # the launcher writes the validated recipe out and each component reads it back
    again = Recipe.model_validate(recipe.model_dump(mode="json"))
    assert again.pools == recipe.pools and again.policies == recipe.policies


@pytest.mark.parametrize(("section", "edit", "expected"), [
    ("engine", {"tokens_per_sec": 250}, "pools.0.engine: engine 'simulated': tokens_per_sec: Extra inputs"),
    ("engine", {"speed": "fast"}, "pools.0.engine: engine 'simulated': speed: Input should be a valid number"),
    ("engine", {"type": "simulatd"}, "pools.0.engine: unknown engine 'simulatd'; registered: ['hf', 'simulated'"),
    ("engine", {"simulated": {"speed": 1.0}}, "pools.0.engine: engine 'simulated': simulated: Extra inputs"),
    ("backend", {"step_base": 0.1}, "policies.0.backend: trainer backend 'simulated': step_base: Extra inputs"),
    ("backend", {"lr": 1e-3}, "policies.0.backend: trainer backend 'simulated': lr: Extra inputs"),
])
def test_a_typo_in_an_engine_or_backend_option_is_refused_at_recipe_load(tmp_path, section, edit, expected):
    data = yaml.safe_load(Path("examples/recipes/sim_single.yaml").read_text())
    target = data["pools"][0] if section == "engine" else data["policies"][0]
    target[section].update(edit)
    path = tmp_path / "recipe.yaml"
    data["policies"][0]["model"] = str(Path("examples/models/tiny.yaml").resolve())
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        Recipe.load(path)
    assert expected in str(err.value)
