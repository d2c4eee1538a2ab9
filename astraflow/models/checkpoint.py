"""A policy's checkpoint: any source resolved to a local Hugging Face directory, then loaded.

Sources: a checkpoint directory (config.json, safetensors, tokenizer files, optional chat
template); ``s3://bucket/prefix`` holding one (downloaded once into the cache); a ``.gguf`` file
(converted once into a bf16 directory in the cache; ``gguf:<package>`` names one shipped in an
installed Python package); a tiny-model ``.yaml`` spec (materialised once).
Cached results are written to a temporary directory and renamed into place, so processes that
resolve the same source at once never see half a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.config import ClusterConfig, ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TINY_FORMAT = "tiny-v2"
"""Bumped when the materialised tiny checkpoint changes for the same spec."""
GGUF_FORMAT = "gguf-v1"
"""Bumped when the GGUF conversion changes for the same file."""
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def cache_root() -> Path:
    """Where resolved checkpoints live: ``$ASTRAFLOW_MODEL_CACHE`` or ``~/.cache/astraflow/models``."""
    return Path(os.environ.get("ASTRAFLOW_MODEL_CACHE") or Path.home() / ".cache" / "astraflow" / "models")


def _local_path(source: str, base: Path | None) -> Path:
    p = Path(source).expanduser()
    if not p.is_absolute() and base is not None and (base / p).exists():
        return base / p
    return p


def _is_spec(path: Path) -> bool:
    return path.suffix in (".yaml", ".yml")


def check_model_source(source: str, *, base: Path | None = None) -> None:
    """Cheap checks done when a recipe loads (no model is read): the source exists and, for a
    directory, holds a config, weights, tokenizer files and an eos token. ConfigError names it."""
    if source.startswith("s3://"):
        from astraflow.models.remote import parse_s3

        parse_s3(source)
        return
    if source.startswith("gguf:"):
        from astraflow.models.gguf import check_gguf_file, packaged_gguf

        check_gguf_file(packaged_gguf(source))
        return
    path = _local_path(source, base)
    if _is_spec(path):
        from astraflow.models.build import ModelConfig

        if not path.is_file():
            raise ConfigError(f"tiny-model spec {path} not found")
        ModelConfig.load(path)
        return
    if path.suffix == ".gguf":
        from astraflow.models.gguf import check_gguf_file

        check_gguf_file(path)
        return
    check_checkpoint_dir(path)


def check_checkpoint_dir(path: Path) -> None:
    """A Hugging Face checkpoint directory with config, weights, tokenizer and an eos token."""
    if not path.is_dir():
        raise ConfigError(f"checkpoint directory {path} not found")
    if not (path / "config.json").is_file():
        raise ConfigError(f"checkpoint {path}: no config.json")
    if not any(next(path.glob(g), None) for g in WEIGHT_GLOBS):
        raise ConfigError(f"checkpoint {path}: no weights (*.safetensors)")
    for index in path.glob("*.index.json"):
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ConfigError(f"checkpoint {path}: weight shards listed in {index.name} are missing: "
                              f"{', '.join(missing)}")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"checkpoint {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    if _declared_eos(path) is None:
        raise ConfigError(f"checkpoint {path}: the tokenizer has no eos token (episodes could never end); "
                          "set eos_token in tokenizer_config.json")


def _declared_eos(path: Path) -> Any:
    for name, key in (("tokenizer_config.json", "eos_token"), ("special_tokens_map.json", "eos_token"),
                      ("generation_config.json", "eos_token_id")):
        f = path / name
        if f.is_file():
            value = json.loads(f.read_text()).get(key)
            if value not in (None, "", []):
                return value
    return None


def resolve_checkpoint(source: str, *, base: Path | None = None, cache_dir: Path | None = None,
                       cluster: ClusterConfig | None = None) -> Path:
    """The local checkpoint directory of ``source`` (see the module docstring). ``cluster``: whose
    S3 endpoint and credentials an ``s3://`` source is read with (default: ``ClusterConfig.load()``,
    i.e. ``$ASTRAFLOW_CONFIG`` / ``ASTRAFLOW_*`` variables, else the embedded stack)."""
    check_model_source(source, base=base)
    cache = cache_dir or cache_root()
    if source.startswith("s3://"):
        from astraflow.models.remote import download_checkpoint

        # A prefix is treated as immutable: keyed by its name, a cached copy needs no request at all.
        key = hashlib.sha256(source.rstrip("/").encode()).hexdigest()[:16]
        return _cached(cache / f"s3-{key}", lambda out: download_checkpoint(source, out, cluster=cluster))
    if source.startswith("gguf:"):
        from astraflow.models.gguf import convert_gguf, packaged_gguf

        gguf = packaged_gguf(source)
        return _cached(cache / f"gguf-{gguf.stem}-{_file_key(gguf)}", lambda out: convert_gguf(gguf, out))
    path = _local_path(source, base)
    if path.suffix == ".gguf":
        from astraflow.models.gguf import convert_gguf

        return _cached(cache / f"gguf-{path.stem}-{_file_key(path)}", lambda out: convert_gguf(path, out))
    if _is_spec(path):
        from astraflow.models.build import ModelConfig
        from astraflow.models.tiny import materialise

        spec = ModelConfig.load(path)
        key = hashlib.sha256(f"{TINY_FORMAT}\n{spec.model_dump_json()}".encode()).hexdigest()[:16]
        return _cached(cache / f"tiny-{path.stem}-{key}", lambda out: materialise(spec, out))
    return path.resolve()


def _file_key(path: Path) -> str:
    st = path.stat()
    stamp = f"{GGUF_FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(stamp.encode()).hexdigest()[:16]


def _cached(target: Path, build: Callable[[Path], Any]) -> Path:
    """``target``, built by ``build`` into a temporary sibling and renamed into place once."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(path: Path, *, trust_remote_code: bool = False, dtype: Any = None) -> PreTrainedModel:
    """The checkpoint's causal LM (fp32 unless ``dtype``: the trainer keeps fp32 master weights)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load would flood every component's log
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                 dtype=dtype or torch.float32)
    return model.eval()


def load_tokenizer(path: Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer exactly as its ``tokenizer.json`` defines it (left padding; pad =
    eos when it declares none).

    ``AutoTokenizer`` picks a class by the model type, and in transformers 5 a model-specific class
    (e.g. ``Qwen2Tokenizer``) rebuilds the pre-tokenizer from its own defaults: a Qwen2 checkpoint
    with its own BPE tokenizer would then be tokenised differently from how it was trained. When
    that happens the generic fast tokenizer is loaded from the file instead."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not _pipeline_matches_file(tok, path):
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    if tok.eos_token_id is None:
        raise ConfigError(f"checkpoint {path}: the tokenizer has no eos token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _pipeline_matches_file(tok: Any, path: Path) -> bool:
    """Whether a loaded fast tokenizer normalises and pre-tokenises as its tokenizer.json says."""
    file = path / "tokenizer.json"
    backend = getattr(tok, "backend_tokenizer", None)
    if not file.is_file() or backend is None:
        return True
    want, have = json.loads(file.read_text()), json.loads(backend.to_str())
    return all(want.get(k) == have.get(k) for k in ("normalizer", "pre_tokenizer"))
