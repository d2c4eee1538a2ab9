"""The demo's tiny model, materialised as a real Hugging Face checkpoint directory.

From a small YAML spec (``examples/models/tiny.yaml``): a byte-level BPE tokenizer trained in code
with ``tokenizers`` on a generated corpus (digits split one per token, so arithmetic is learnable),
ChatML special tokens and chat template, tool-call tokens, and a seeded Qwen2 / Llama model sized to
the vocabulary — written with ``save_pretrained``. Nothing is downloaded, and everything downstream
(trainer, nodes, warm start, evaluation) loads it exactly as it loads a user's checkpoint.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

from astraflow.models.build import ModelConfig

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
EXTRA_SPECIAL = ["<yes>", "<no>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Verifier verdicts (one token each) and the Hermes tool-call delimiters."""
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML: every turn is ``<|im_start|>role\\ncontent<|im_end|>\\n``; eos is ``<|im_end|>``."""

_INIT_LOCK = threading.Lock()

_WORDS = ["apples", "sheep", "books", "coins", "stamps", "marbles", "tickets", "boxes", "bottles", "pages",
          "cards", "shells", "eggs", "birds", "trees", "cars", "bricks", "seeds"]
_NAMES = ["Ann", "Ben", "Cara", "Dev", "Emma", "Finn", "Gus", "Hana", "Ivan", "Jo", "Kim", "Leo", "Mia", "Ned",
          "Omar", "Pia"]


def tokenizer_corpus(seed: int = 0, n: int = 4000) -> Iterator[str]:
    """Text the tiny tokenizer is trained on: the demo tasks' prompts, word problems and tool-call
    transcripts (so frequent words and the call syntax get their own tokens)."""
    rng = random.Random(f"tiny-tokenizer/{seed}")
    for _ in range(n):
        xs = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
        op = rng.choice(["max", "min"])
        yield f"{op} {' '.join(xs)} = {max(xs) if op == 'max' else min(xs)}"
        a, b = rng.randrange(10, 10_000), rng.randrange(10, 10_000)
        name, thing = rng.choice(_NAMES), rng.choice(_WORDS)
        yield (f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now? "
               f"{name} had {a} {thing} and gave away {b}. How many are left? "
               f"Each box holds {a} {thing}. How many {thing} are in {b} boxes? Answer: {a + b}")
        yield (f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}+{b}"}}}}</tool_call> '
               f"<tool_response>{a * b}</tool_response> The answer is {a - b}.")
        yield (f"{IM_START}system\nYou can call tools. Tools: calculator: evaluate an arithmetic expression."
               f"{IM_END}\n{IM_START}user\nWhat is {a} plus {b}?{IM_END}\n{IM_START}assistant\n")


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained in code, with ChatML specials and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    # GPT-2's split, except that a number is split into single digits (each keeps a leading space),
    # so "max 3 7 =" is four tokens and "347" is "3", "4", "7": arithmetic stays learnable.
    split = Regex(r" ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, IM_START, IM_END, *EXTRA_SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(tokenizer_corpus(seed), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD,
                                   additional_special_tokens=[IM_START, *EXTRA_SPECIAL],
                                   chat_template=CHAT_TEMPLATE, padding_side="left",
                                   model_max_length=0)


def materialise(spec: ModelConfig, out: Path) -> Path:
    """Write the tiny checkpoint (model + tokenizer + chat template) of ``spec`` into ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tok = build_tokenizer(spec.vocab_size, spec.seed)
    tok.model_max_length = spec.max_position_embeddings
    hf_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if spec.arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = hf_cls(
        vocab_size=len(tok), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id,
    )
    # transformers' initialisers use the global RNG: seed it, then restore the caller's state; the
    # lock keeps two threads materialising at once from drawing from each other's stream.
    with _INIT_LOCK:
        state = torch.random.get_rng_state()
        try:
            torch.manual_seed(spec.seed)
            model = model_cls(config)
        finally:
            torch.random.set_rng_state(state)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
