"""``sampling.regenerate_stale_after``: a group's continuations with no token near the weights now
served are generated again, once, under those weights; the rest (a long sample's fresh tail) are kept."""

import asyncio

import pytest
from fakes import FakeEngine
from pydantic import ValidationError

from astraflow.engines.base import Generation
from astraflow.workflows import SamplingConfig
from astraflow.workflows.policy import policy_client

FIRST = [[3, 3, 4, 5, 6, 7], [3, 3], [4, 4, 4], [5]]
"""A long sample decoded from v3 to v7, and three short siblings decoded at v3, v4 and v5."""


def versioned_engine(first: list[list[int]], now: int) -> FakeEngine:
    """Serves version ``now``; its first prompts are answered with ``first`` (per prompt: the
    versions of its tokens), later ones with one token at ``now``; each token is the prompt's first."""
    def reply(p: list[int], k: int) -> Generation:
        if k < len(first):
            v = first[k]
            return Generation([p[0]] * len(v), [-1.0] * len(v), list(v), "stop")
        return Generation([p[0]], [-0.5], [now], "stop")
    return FakeEngine(reply, version=now)


def calls(engine: FakeEngine) -> list[list[int]]:
    """Per ``generate`` call, the first token of each prompt."""
    return [[p[0] for p in prompts] for prompts in engine.requests]


def _generate(tiny_tokenizer, lag: int | None) -> tuple[FakeEngine, list[Generation], dict]:
    engine = versioned_engine(FIRST, now=7)
    client = policy_client("policy", engine, tiny_tokenizer, SamplingConfig(regenerate_stale_after=lag))
    gens = asyncio.run(client.generate([[10], [11], [12], [13]]))
    return engine, gens, dict(client.counters)


def test_siblings_with_no_fresh_token_are_generated_again(tiny_tokenizer):
    engine, gens, counters = _generate(tiny_tokenizer, lag=2)  # fresh: a token at v5 or later
    assert calls(engine) == [[10, 11, 12, 13], [11, 12]]  # v3 and v4 siblings, once; v5 is within the lag
    assert [g.versions for g in gens] == [[3, 3, 4, 5, 6, 7], [7], [7], [5]]  # in their places
    assert [g.token_ids[0] for g in gens] == [10, 11, 12, 13]
    assert counters == {"regenerated": 2, "regenerated_tokens": 5}


@pytest.mark.parametrize("lag", [None, 4])
def test_nothing_is_generated_again_when_off_or_all_fresh(tiny_tokenizer, lag):
    engine, gens, counters = _generate(tiny_tokenizer, lag=lag)
    assert len(calls(engine)) == 1 and [g.versions for g in gens] == FIRST and not counters


def test_the_setting_is_validated():
    with pytest.raises(ValidationError, match="regenerate_stale_after"):
        SamplingConfig(regenerate_stale_after=-1)
