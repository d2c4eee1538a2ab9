"""A user's own checkpoint, end to end: a Llama-architecture directory written by ``save_pretrained``
with its own BPE tokenizer and chat template (not the project's) trains with ``astraflow run`` by
naming its path — single-turn and multi-turn (tool calls) — and the weights it published export to a
checkpoint directory that ``from_pretrained`` loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astraflow.launcher.cluster import write_cluster_file

ROOT = Path(__file__).parent.parent
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ZEPHYR_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
"""A Zephyr-style template: different role markers and eos from the project's ChatML."""


def make_user_checkpoint(out: Path) -> Path:
    """A small Llama with a whitespace + byte-level BPE tokenizer (GPT-2 split, numbers not split
    into digits), eos ``</s>``, no pad token — built the way a user would, with public APIs only."""
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(7)
    corpus = [f"Sam has {rng.randrange(100)} pens and gets {rng.randrange(100)} more. max {rng.randrange(10)} "
              f"{rng.randrange(10)} = <tool_call> calculator expression 12+30 </tool_call>" for _ in range(500)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"],
                                  chat_template=ZEPHYR_TEMPLATE)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=False,
                                         eos_token_id=tok.eos_token_id, bos_token_id=None))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _recipe(tmp_path: Path, checkpoint: Path, workflow: dict, dataset: dict, name: str) -> Path:
    data = {
        "run": name, "seed": 0, "dataset": {**dataset, "samples": 2}, "workflow": workflow,
        "policies": [{"name": "agent", "model": str(checkpoint), "backend": {"lr": 1e-3}}],
        "pools": [{"name": "default", "nodes": 1, "concurrency": 8}],
        "sampling": {"agent": {"max_new_tokens": 8}},
        "dataflow": {"groups_per_batch": 2, "max_staleness": 1},
        "trainer": {"steps": 2, "checkpoint_every": 1, "anchor_every": 10},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(recipe: Path, cluster, tmp_path: Path, run_id: str) -> subprocess.CompletedProcess:
    cluster_file = write_cluster_file(cluster, tmp_path / "cluster.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_")}
    env["ASTRAFLOW_CONFIG"] = str(cluster_file)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "run", str(recipe), "--run-id", run_id,
           "--runs-dir", str(tmp_path / "runs"), "--no-live", "--timeout", "150", "--grace", "5"]
    return subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path)


def _trained_steps(run_dir: Path) -> int:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r.get("component") == "trainer" and not r.get("event") and "step" in r]
    return max(steps, default=0)


def test_users_llama_checkpoint_trains_single_and_multi_turn_and_exports(test_cluster, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from astraflow.models import load_tokenizer

    ckpt = make_user_checkpoint(tmp_path / "my-llama")
    tok = load_tokenizer(ckpt)
    assert tok.eos_token == "</s>" and "<|assistant|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)

    single = _recipe(tmp_path, ckpt, {"type": "math", "policy": "agent", "reward": "exact_match"},
                     {"type": "minmax"}, "user-single")
    proc = _run(single, test_cluster, tmp_path, test_cluster.run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _trained_steps(tmp_path / "runs" / test_cluster.run) == 2

    multi = _recipe(tmp_path, ckpt, {"type": "tool_agent", "policy": "agent", "tools": [{"type": "calculator"}],
                                     "reward": "last_number", "max_turns": 3, "system_prompt": "Use tools."},
                    {"type": "jsonl", "path": str(ROOT / "examples" / "data" / "word_problems.jsonl"),
                     "fields": {"prompt": "question", "answer": "answer"}}, "user-multi")
    multi_run = f"{test_cluster.run}-multi"
    proc = _run(multi, test_cluster, tmp_path, multi_run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _trained_steps(tmp_path / "runs" / multi_run) == 2

    # the published weights keep the checkpoint's parameter names: exported, from_pretrained loads them
    from astraflow.delta.subscriber import WeightSubscriber
    from astraflow.models.export import export_checkpoint

    sub = WeightSubscriber(test_cluster.model_copy(update={"run": multi_run}), "agent", "test-export", register=False)
    try:
        state, version, _ = sub.pull(None)
    finally:
        sub.close(unregister=False)
    assert version == 2
    out = export_checkpoint(ckpt, state, tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    loaded_state = loaded.state_dict()
    for name, tensor in state.items():
        assert name in loaded_state, name
        assert loaded_state[name].to(tensor.dtype).equal(tensor), name
