"""The simulated engine and trainer backend (no broker): timing, length distribution, versions."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from astraflow.engines import build_engine
from astraflow.engines.base import SamplingParams
from astraflow.engines.simulated import SimulatedEngineConfig
from astraflow.trainer.backend import build_backend


def test_length_distribution_matches_the_stated_quantiles():
    cfg = SimulatedEngineConfig(median_tokens=48, sigma=1.0, max_tokens=100_000)
    rng = random.Random(0)
    xs = sorted(cfg.draw_length(rng) for _ in range(20_000))
    assert abs(xs[len(xs) // 2] - 48) <= 2
    assert 0.85 < xs[int(0.99 * len(xs))] / cfg.quantile(0.99) < 1.15
    assert abs(cfg.quantile(0.99) - 48 * 10.24) < 1


def test_continuous_batching_time_follows_the_longest_sequence_and_versions_change_mid_sequence():
    eng = build_engine({"type": "simulated", "simulated": {"tokens_per_s": 400, "median_tokens": 200,
                                                            "sigma": 0.0, "max_tokens": 200}}, None)
    params = SamplingParams(max_new_tokens=1000)

    async def run():
        t0 = time.monotonic()
        swap = threading.Timer(0.25, lambda: eng.load_weights({"w": 1}, 7))
        swap.start()
        outs = await asyncio.gather(*[eng.agenerate([[1]] * 4, params) for _ in range(8)])
        return time.monotonic() - t0, [g for o in outs for g in o]

    secs, gens = asyncio.run(run())
    assert 0.4 < secs < 1.5  # 32 sequences of 200 tokens at 400 tok/s each, decoded together
    assert all(len(g.token_ids) == 200 and g.finish_reason == "stop" and g.token_ids[-1] == 2 for g in gens)
    assert all(g.versions[0] == 0 and g.versions[-1] == 7 for g in gens)  # swapped mid-sequence


def test_cap_and_strict_weight_names():
    eng = build_engine({"type": "simulated", "simulated": {"tokens_per_s": 5000, "median_tokens": 50}}, None)
    (g,) = eng.generate([[1]], SamplingParams(max_new_tokens=3))
    assert len(g.token_ids) <= 3
    eng.load_weights({"a": 1}, 1)
    try:
        eng.load_weights({"b": 1}, 2)
    except ValueError as exc:
        assert "tensor names changed" in str(exc)
    else:
        raise AssertionError("a changed tensor set must be refused")


def test_simulated_backend_step_time_scales_with_tokens_and_weights_change():
    class T:
        def __init__(self, n):
            self.loss_mask, self.reward = [1] * n, 0.0

    be = build_backend(None, {"type": "simulated", "simulated": {"step_base_s": 0.0, "step_s_per_token": 1e-3,
                                                                 "params": 1000}})
    w0 = be.state_dict()["simulated.weight"]
    t0 = time.perf_counter()
    be.step([T(100)])
    short = time.perf_counter() - t0
    t0 = time.perf_counter()
    be.step([T(300)])
    long = time.perf_counter() - t0
    assert 0.09 < short < 0.25 and 0.29 < long < 0.5
    assert (be.state_dict()["simulated.weight"] != w0).sum() > 0
