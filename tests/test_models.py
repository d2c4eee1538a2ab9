"""Tokenizer round trip and seeded, deterministic model construction."""

import pytest
import torch

from astraflow.config import ConfigError
from astraflow.models import NO, YES, ModelConfig, build_model, build_tokenizer, compact
from astraflow.tasks import build_dataset, split_of

TINY = "examples/models/tiny.yaml"


def test_tokenizer_round_trip():
    tok = build_tokenizer()
    for text in ["max 3 7 1 9 =", "12 + 345 = 357", f"max 3 7 = 7 {YES}", NO]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id not in ids
        assert compact(tok.decode(ids)) == compact(text)
    # every digit is its own token
    assert len(tok.encode("1234", add_special_tokens=False)) == 4
    assert tok.encode("@", add_special_tokens=False) == [tok.unk_token_id]


def test_model_builds_deterministically_from_seed():
    a, b = build_model(TINY), build_model(TINY)
    assert type(a).__name__ == "Qwen2ForCausalLM"
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    c = build_model(ModelConfig.load(TINY).model_copy(update={"seed": 1}))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    llama = build_model(ModelConfig.load(TINY).model_copy(update={"arch": "llama"}))
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert a.config.vocab_size == len(build_tokenizer())


def test_building_a_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(TINY)
    assert torch.equal(torch.rand(3), expected)


def test_dataset_splits_are_disjoint_and_seeded():
    ds = build_dataset("minmax", seed=0)
    train = ds.problems("train", 300)
    held = ds.problems("heldout", 100)
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})
    assert all(split_of(p.prompt, ds.heldout_fraction) == "heldout" for p in held)
    assert held == build_dataset("minmax", seed=0).problems("heldout", 100)
    for p in held[:20]:
        op, *xs, eq = p.prompt.split()
        assert eq == "=" and p.answer == str((max if op == "max" else min)(map(int, xs)))
    add = build_dataset("add", digits=2).problems("train", 5)
    for p in add:
        a, _, b, _ = p.prompt.split()
        assert int(p.answer) == int(a) + int(b)


def test_missing_model_config_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="model config not found: .*nope.yaml"):
        ModelConfig.load(tmp_path / "nope.yaml")
