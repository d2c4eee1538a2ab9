"""``sampling.regenerate_stale_after``: a group's continuations with no token near the weights now
served are generated again, once, under those weights; the rest (a long sample's fresh tail) are kept."""

import asyncio

import pytest
from pydantic import ValidationError

from astraflow.engines.base import Engine, Generation
from astraflow.workflows import SamplingConfig
from astraflow.workflows.policy import policy_client


class VersionedEngine(Engine):
    """Serves version ``now``; its first call returns ``first`` (per prompt: the versions of its
    tokens), later calls one token per prompt at ``now``."""

    def __init__(self, first: list[list[int]], now: int) -> None:
        self.first, self.now, self.calls = first, now, []

    def generate(self, prompts, params):
        self.calls.append([p[0] for p in prompts])
        if len(self.calls) == 1:
            return [Generation([p[0]] * len(v), [-1.0] * len(v), list(v), "stop") for p, v in zip(prompts, self.first)]
        return [Generation([p[0]], [-0.5], [self.now], "stop") for p in prompts]

    def load_weights(self, state_dict, version):
        raise NotImplementedError

    @property
    def weight_version(self):
        return self.now

    def state_dict(self):
        return {}


FIRST = [[3, 3, 4, 5, 6, 7], [3, 3], [4, 4, 4], [5]]
"""A long sample decoded from v3 to v7, and three short siblings decoded at v3, v4 and v5."""


def _generate(tiny_tokenizer, lag: int | None) -> tuple[VersionedEngine, list[Generation], dict]:
    engine = VersionedEngine(FIRST, now=7)
    client = policy_client("policy", engine, tiny_tokenizer, SamplingConfig(regenerate_stale_after=lag))
    gens = asyncio.run(client.generate([[10], [11], [12], [13]]))
    return engine, gens, dict(client.counters)


def test_siblings_with_no_fresh_token_are_generated_again(tiny_tokenizer):
    engine, gens, counters = _generate(tiny_tokenizer, lag=2)  # fresh: a token at v5 or later
    assert engine.calls == [[10, 11, 12, 13], [11, 12]]  # v3 and v4 siblings, once; v5 is within the lag
    assert [g.versions for g in gens] == [[3, 3, 4, 5, 6, 7], [7], [7], [5]]  # in their places
    assert [g.token_ids[0] for g in gens] == [10, 11, 12, 13]
    assert counters == {"regenerated": 2, "regenerated_tokens": 5}


@pytest.mark.parametrize("lag", [None, 4])
def test_nothing_is_generated_again_when_off_or_all_fresh(tiny_tokenizer, lag):
    engine, gens, counters = _generate(tiny_tokenizer, lag=lag)
    assert len(engine.calls) == 1 and [g.versions for g in gens] == FIRST and not counters


def test_the_setting_is_validated():
    with pytest.raises(ValidationError, match="regenerate_stale_after"):
        SamplingConfig(regenerate_stale_after=-1)
