"""Object-store throughput: parallel multipart put/get vs a single PUT/GET, on the real S3 server.

Runs against ``ASTRAFLOW_S3_ENDPOINT`` (with ``ASTRAFLOW_S3_ACCESS_KEY``/``_SECRET_KEY``) if set,
otherwise starts the embedded stack (SeaweedFS) in a temporary directory and stops it afterwards.

Measured side by side on the same object size, median of ``--reps`` runs:

* ``raw_put`` / ``raw_get``: one boto3 ``put_object`` / ``get_object`` with no checksum (baseline)
* ``put_bytes`` / ``get_bytes``: the layer's single request, sha256 computed and verified
* ``put_file`` / ``get_file``: the layer's file transfer, sha256 computed and verified, once as parallel
  multipart (``*_multipart``) and once as a single request (``*_single``, multipart switched off)

Prints one JSON line last: MB/s per mode (MB = 10^6 bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def _cluster() -> Iterator[object]:
    from astraflow.config import ClusterConfig

    if os.environ.get("ASTRAFLOW_S3_ENDPOINT"):
        yield ClusterConfig.load()
        return
    from astraflow.embedded import EmbeddedStack, StackPorts

    with tempfile.TemporaryDirectory(prefix="af-objbench-") as state:
        stack = EmbeddedStack(Path(state), StackPorts.free(), storage="memory", die_with_parent=True)
        stack.up()
        try:
            yield ClusterConfig(run="objbench", state_dir=Path(state)).resolve()
        finally:
            stack.down()


def _median_mbps(fn: Callable[[], object], nbytes: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(nbytes / statistics.median(times) / 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="object size in MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--part-mib", type=int, default=8, help="multipart part size in MiB")
    ap.add_argument("--concurrency", type=int, default=8, help="multipart threads")
    args = ap.parse_args()

    from astraflow.objstore import ObjectStore

    nbytes = args.mib * 1024 * 1024
    data = os.urandom(nbytes)
    with _cluster() as cfg, tempfile.TemporaryDirectory(prefix="af-objbench-files-") as tmp:
        store = ObjectStore.from_config(
            cfg,  # type: ignore[arg-type]
            multipart_threshold=args.part_mib * 1024 * 1024,
            multipart_chunksize=args.part_mib * 1024 * 1024,
            max_concurrency=args.concurrency,
        )
        # the same layer with multipart switched off: one PUT / one GET streamed from/to the file
        single = ObjectStore(store.client, store.bucket, store.endpoint, multipart_threshold=1 << 62)
        src, dst = Path(tmp) / "src.bin", Path(tmp) / "dst.bin"
        src.write_bytes(data)
        prefix = f"{cfg.run}/bench-{os.getpid()}/"  # type: ignore[attr-defined]
        raw, bucket = store.client, store.bucket

        def raw_get() -> bytes:
            return raw.get_object(Bucket=bucket, Key=prefix + "raw")["Body"].read()

        result = {
            "raw_put": _median_mbps(
                lambda: raw.put_object(Bucket=bucket, Key=prefix + "raw", Body=data), nbytes, args.reps
            ),
            "put_bytes": _median_mbps(lambda: store.put_bytes(prefix + "single", data), nbytes, args.reps),
            "put_file_multipart": _median_mbps(
                lambda: store.put_file(prefix + "multi", src), nbytes, args.reps
            ),
            "put_file_single": _median_mbps(
                lambda: single.put_file(prefix + "fsingle", src), nbytes, args.reps
            ),
            "raw_get": _median_mbps(raw_get, nbytes, args.reps),
            "get_bytes": _median_mbps(lambda: store.get_bytes(prefix + "single"), nbytes, args.reps),
            "get_file_multipart": _median_mbps(
                lambda: store.get_file(prefix + "multi", dst), nbytes, args.reps
            ),
            "get_file_single": _median_mbps(
                lambda: single.get_file(prefix + "fsingle", dst), nbytes, args.reps
            ),
        }
        assert dst.read_bytes() == data and store.get_bytes(prefix + "single") == data
        parts = store.head(prefix + "multi")["etag"].rpartition("-")[2]
        store.delete_many(store.list(prefix))

    line = {
        "benchmark": "objstore_transfer",
        "endpoint": "external" if os.environ.get("ASTRAFLOW_S3_ENDPOINT") else "embedded seaweedfs",
        "object_mib": args.mib,
        "part_mib": args.part_mib,
        "concurrency": args.concurrency,
        "multipart_parts": int(parts) if parts.isdigit() else 1,
        "reps": args.reps,
        "mb_per_s": result,
        "multipart_put_speedup_vs_single": round(result["put_file_multipart"] / result["put_file_single"], 2),
        "multipart_get_speedup_vs_single": round(result["get_file_multipart"] / result["get_file_single"], 2),
        "checksum_put_overhead_vs_raw": round(result["raw_put"] / result["put_bytes"], 2),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
