"""Read back TensorBoard event files (TFRecord framing, ``Event`` protos as tensorboardX ships them)."""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``logdir``: tag -> [(step, value)] in file order."""
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
