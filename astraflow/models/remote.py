"""Checkpoints kept in a bucket: ``s3://bucket/prefix`` downloaded into a local directory.

Components run anywhere the bucket is reachable, so a policy's checkpoint can live next to its
weights instead of being copied to every machine. The credentials and endpoint are the cluster's
(``ClusterConfig``: YAML / ``ASTRAFLOW_*`` variables, or the embedded stack's); only the bucket
comes from the source. Files the project wrote carry a sha256 and are verified; files uploaded
with other tools (``aws s3 cp``) are checked by size. The download is refused unless it is a
complete checkpoint (config, every weight shard, tokenizer with an eos token).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from astraflow.config import ClusterConfig, ConfigError
from astraflow.objstore import ObjectStore, ObjectStoreError

if TYPE_CHECKING:
    from rich.console import Console


def parse_s3(source: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ``("bucket", "some/prefix")``; ConfigError when malformed."""
    bucket, _, prefix = source.removeprefix("s3://").strip("/").partition("/")
    if not source.startswith("s3://") or not bucket or not prefix.strip("/"):
        raise ConfigError(f"model source {source!r}: expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


def source_store(source: str, cluster: ClusterConfig | None = None) -> ObjectStore:
    """An object store on the cluster's S3 endpoint, opened on the bucket the source names."""
    cfg = cluster if cluster is not None else ClusterConfig.load()
    if cfg.s3.endpoint is None:
        cfg = cfg.resolve()
    bucket, _ = parse_s3(source)
    cfg = cfg.model_copy(update={"s3": cfg.s3.model_copy(update={"bucket": bucket})})
    try:
        return ObjectStore.from_config(cfg)
    except ObjectStoreError as exc:
        raise ConfigError(f"model source {source}: {exc}") from exc


def download_checkpoint(source: str, out: Path, *, cluster: ClusterConfig | None = None,
                        console: Console | None = None) -> Path:
    """Every object under the source's prefix, written below ``out`` at its relative path, with a
    byte progress bar when ``console`` (default: stderr) is a terminal."""
    from astraflow.models.checkpoint import check_checkpoint_dir
    from astraflow.objstore.progress import transfer_progress

    _, prefix = parse_s3(source)
    store = source_store(source, cluster)
    try:
        keys = [k for k in store.list(prefix + "/") if not k.endswith("/")]
        if not keys:
            raise ConfigError(f"model source {source}: no objects under that prefix on {store.endpoint}")
        for key in keys:
            if any(part in ("", ".", "..") for part in PurePosixPath(key[len(prefix) + 1:]).parts):
                raise ConfigError(f"model source {source}: refusing object key {key!r}")
        heads = {key: store.head(key) for key in keys}
        with transfer_progress(store, source, sum(h["size"] for h in heads.values()), console=console):
            for key, head in heads.items():
                target = out.joinpath(*PurePosixPath(key[len(prefix) + 1:]).parts)
                store.get_file(key, target, verify=head["sha256"] is not None)
                if target.stat().st_size != head["size"]:
                    raise ConfigError(f"model source {source}: {key} downloaded incompletely")
    except ObjectStoreError as exc:
        raise ConfigError(f"model source {source}: {exc}") from exc
    try:
        check_checkpoint_dir(out)
    except ConfigError as exc:
        raise ConfigError(f"model source {source} is not a complete checkpoint: {exc}") from None
    return out
