"""Read back what the metrics sinks wrote, with each library's own record types: TensorBoard event files
(TFRecord framing, tensorboardX's ``Event`` protos) and W&B offline runs (``.wandb`` files: LevelDB log
framing of wandb's ``Record`` protos, the format ``wandb sync`` uploads)."""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections import defaultdict
from pathlib import Path


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``logdir``: tag -> [(step, value)] in file order."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            event = Event.FromString(data[pos + 12: pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, the record, its crc
            for value in event.summary.value:
                out[value.tag].append((event.step, value.simple_value))
    return dict(out)


WANDB_HEADER = struct.Struct("<4sHB")
"""A ``.wandb`` file opens with ``:W&B``, the magic 0xBEE1 and a version byte (0)."""
LEVELDB_BLOCK = 32768
LEVELDB_RECORD = struct.Struct("<IHB")
"""crc32 (zlib's, of the type byte and the fragment), length, type (1 full, 2 first, 3 middle, 4 last) before each fragment; blocks of 32 KiB,
a block's tail shorter than this header is zero padding."""


def wandb_records(path: Path) -> list:
    """The ``wandb_internal_pb2.Record`` messages of one ``.wandb`` file, in order."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    ident, magic, version = WANDB_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    records, fragments, pos = [], b"", WANDB_HEADER.size
    while pos + LEVELDB_RECORD.size <= len(data):
        room = LEVELDB_BLOCK - pos % LEVELDB_BLOCK
        if room < LEVELDB_RECORD.size:
            pos += room
            continue
        crc, length, kind = LEVELDB_RECORD.unpack_from(data, pos)
        if kind == 0:  # zero padding (preallocated space at the end)
            break
        payload = data[pos + LEVELDB_RECORD.size: pos + LEVELDB_RECORD.size + length]
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"{path}: bad checksum at {pos}"
        pos += LEVELDB_RECORD.size + length
        fragments = payload if kind in (1, 2) else fragments + payload
        if kind in (1, 4):
            records.append(Record.FromString(fragments))
    return records


def read_wandb_scalars(wandb_dir: Path, step_key: str) -> dict[str, list[tuple[int, float]]]:
    """Every logged scalar of the offline runs under ``wandb_dir``: key -> [(row[step_key], value)] in
    the order written (``_``-prefixed keys, W&B's own, left out)."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in sorted(wandb_dir.rglob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_") and key != step_key:
                    out[key].append((int(row[step_key]), float(value)))
    return dict(out)


def read_mlflow_scalars(tracking_uri: str, experiment: str, run_name: str,
                        tags: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """The metric history of each of ``tags`` in the MLflow run ``run_name``, through MLflow's own client:
    tag -> [(step, value)] by step."""
    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as the sink does: MLflow 3 refuses it otherwise
    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                                filter_string=f"tags.`mlflow.runName` = '{run_name}'")
    return {tag: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)) for tag in tags}
