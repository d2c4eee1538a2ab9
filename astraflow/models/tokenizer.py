"""A tokenizer built in code (nothing is downloaded): a word-level vocabulary of digits, operators,
task words and verifier verdict tokens, wrapped as a ``transformers.PreTrainedTokenizerFast``.

Text is split on whitespace and every digit is its own token, so ``"max 12 7 ="`` encodes as
``max 1 2 7 =``. Decoding joins tokens with spaces; :func:`compact` removes them for answer checks.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
YES, NO = "<yes>", "<no>"
"""Verifier verdict tokens: a verifier's whole response is one of these (then EOS)."""
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, YES, NO]
WORDS = [
    *[str(d) for d in range(10)],
    "+", "-", "*", "=", "(", ")", ",", ":", "?", "|",
    "max", "min", "sum", "answer", "check",
]


@lru_cache(maxsize=1)
def build_tokenizer() -> PreTrainedTokenizerFast:
    """The project tokenizer (cached: it is immutable and shared by models, engines and tasks)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left",
    )
    tok.add_special_tokens({"additional_special_tokens": [YES, NO]})
    return tok


def compact(text: str) -> str:
    """Text without whitespace: ``"1 2"`` -> ``"12"`` (how answers are compared)."""
    return "".join(text.split())
