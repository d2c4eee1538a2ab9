"""A trained version written out as a complete Hugging Face checkpoint directory.

What a user takes away from a run is a directory that ``from_pretrained`` loads anywhere: the
source checkpoint's config, tokenizer and chat template with the trained weights. The weights are
put into a model rebuilt from that config (so tied parameters, dtype and sharding are whatever
``save_pretrained`` makes of them) and refused unless every parameter name matches the checkpoint's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.config import ConfigError

if TYPE_CHECKING:
    import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
"""Files of the source checkpoint that are weights (replaced), not config or tokenizer (copied)."""


def export_checkpoint(source: Path, state: dict[str, torch.Tensor], out: Path, *,
                      trust_remote_code: bool = False) -> Path:
    """Write ``state`` (the policy's parameters, as published) with ``source``'s config and tokenizer
    files into ``out``, which must not exist or be empty. Returns ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export target {out} exists and is not empty")
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    dtype = floats.pop() if len(floats) == 1 else torch.float32
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    expected = set(model.state_dict())
    tied = expected - set(dict(model.named_parameters(remove_duplicate=True))) - set(dict(model.named_buffers()))
    missing, unexpected = expected - set(state) - tied, set(state) - expected
    if missing or unexpected:
        raise ConfigError(f"weights do not fit checkpoint {source} ({type(model).__name__}): "
                          f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False)
    if (source / "generation_config.json").is_file():  # eos / sampling defaults as the source has them
        model.generation_config = GenerationConfig.from_pretrained(source)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    model.save_pretrained(out, safe_serialization=True)  # rewrites config.json with the weights' dtype
    return out
