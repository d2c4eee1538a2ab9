"""Models by path: the tiny spec materialised as a real checkpoint, loading through Auto* classes,
and the checks a recipe's model source gets when the recipe loads."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astraflow.config import ConfigError
from astraflow.models import ModelConfig, check_model_source, load_model, load_tokenizer, resolve_checkpoint
from astraflow.tasks import build_dataset, compact, split_of

TINY = "examples/models/tiny.yaml"


def test_tiny_checkpoint_is_a_real_hf_checkpoint(tiny_checkpoint, tiny_tokenizer):
    names = {p.name for p in tiny_checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "max 3 7 ="}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\nmax 3 7 =<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.padding_side == "left"


def test_tiny_tokenizer_is_byte_level_bpe_with_single_digits(tiny_tokenizer):
    tok = tiny_tokenizer
    for text in ["max 3 7 1 9 =", "Ann has 347 apples. How many?", "<yes>", "ünïcode ☃ works"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text  # byte-level: nothing is unknown
    assert len(tok.encode("1234", add_special_tokens=False)) == 4  # every digit is its own token
    # a digit keeps its leading space: the tokenizer.json's own pre-tokenizer, not Qwen2's default
    # (transformers 5's Qwen2Tokenizer would rebuild it and split off every space)
    assert tok.tokenize("max 3 7 =") == ["max", "Ġ3", "Ġ7", "Ġ="]
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) == 1
    assert len(tok.encode("<yes>", add_special_tokens=False)) == 1
    ids = tok.encode("the sheep and the apples", add_special_tokens=False)
    assert len(ids) < len("the sheep and the apples") / 2  # BPE merges, not characters


def test_materialising_is_deterministic_across_processes(tmp_path):
    code = ("import sys, pathlib; from astraflow.models import resolve_checkpoint; "
            "print(resolve_checkpoint(sys.argv[1], cache_dir=pathlib.Path(sys.argv[2])))")
    dirs = []
    for i in range(2):
        out = subprocess.run([sys.executable, "-c", code, TINY, str(tmp_path / f"c{i}")], capture_output=True,
                             text=True, check=True, env={"PYTHONHASHSEED": str(i), "PATH": "/usr/bin:/bin"})
        dirs.append(out.stdout.strip().splitlines()[-1])
    a, b = (sorted(p for p in __import__("pathlib").Path(d).iterdir()) for d in dirs)
    assert [p.name for p in a] == [p.name for p in b]
    for fa, fb in zip(a, b, strict=True):
        assert fa.read_bytes() == fb.read_bytes(), fa.name


def test_processes_racing_to_materialise_share_one_directory(tmp_path, tiny_checkpoint):
    code = ("import sys, pathlib; from astraflow.models import resolve_checkpoint; "
            "print(resolve_checkpoint(sys.argv[1], cache_dir=pathlib.Path(sys.argv[2])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, TINY, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=240)[0].strip().splitlines()[-1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1]
    assert [p.name for p in tmp_path.iterdir()] == [Path(outs[0]).name]  # the loser's temporary is gone
    for f in tiny_checkpoint.iterdir():
        assert (Path(outs[0]) / f.name).read_bytes() == f.read_bytes(), f.name


def test_resolving_twice_reuses_the_cache(tmp_path):
    first = resolve_checkpoint(TINY, cache_dir=tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_checkpoint(TINY, cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_seed_and_arch_come_from_the_spec(tmp_path):
    spec = ModelConfig.load(TINY)
    base = load_model(resolve_checkpoint(TINY, cache_dir=tmp_path))
    for i, update in enumerate([{"seed": 1}, {"arch": "llama"}]):
        path = tmp_path / f"spec{i}.yaml"
        path.write_text(json.dumps({"model": spec.model_copy(update=update).model_dump()}))
        other = load_model(resolve_checkpoint(str(path), cache_dir=tmp_path))
        if "seed" in update:
            assert not torch.equal(base.model.embed_tokens.weight, other.model.embed_tokens.weight)
        else:
            assert type(other).__name__ == "LlamaForCausalLM"


def test_materialising_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    resolve_checkpoint(TINY, cache_dir=tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_a_checkpoint_directory_is_used_in_place(tiny_checkpoint, tmp_path):
    mine = tmp_path / "my-checkpoint"
    shutil.copytree(tiny_checkpoint, mine)
    assert resolve_checkpoint(str(mine)) == mine.resolve()
    assert resolve_checkpoint("my-checkpoint", base=tmp_path) == mine.resolve()
    assert load_tokenizer(mine).eos_token == "<|im_end|>"


def test_bad_sources_are_refused_naming_the_path_and_the_problem(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="checkpoint directory .*nope not found"):
        check_model_source(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="tiny-model spec .*nope.yaml not found"):
        check_model_source(str(tmp_path / "nope.yaml"))
    broken = tmp_path / "no-eos"
    shutil.copytree(tiny_checkpoint, broken)
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    cfg.pop("eos_token", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(cfg))
    (broken / "generation_config.json").unlink()
    with pytest.raises(ConfigError, match="no-eos: the tokenizer has no eos token"):
        check_model_source(str(broken))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_checkpoint, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weights"):
        check_model_source(str(no_weights))
    with pytest.raises(ConfigError, match="s3://bucket/prefix"):
        check_model_source("s3://only-a-bucket")


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
    for p in build_dataset("add", digits=2).problems("train", 5):
        a, _, b, _ = p.prompt.split()
        assert int(p.answer) == int(a) + int(b)
    assert compact(" 1 2 ") == "12"


def test_missing_model_config_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="model config not found: .*nope.yaml"):
        ModelConfig.load(tmp_path / "nope.yaml")
