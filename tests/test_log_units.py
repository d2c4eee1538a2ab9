"""The log layer's pure parts: topic names, the record format, the commit-prefix bookkeeping."""

from __future__ import annotations

import pyarrow as pa
import pytest
from log_helpers import acked_count

from astraflow.log import ArrowCodec, RecordMeta, SchemaMismatchError, TopicNameError, Topics
from astraflow.log.codec import ARROW_STREAM, JSON, check_schema
from astraflow.log.errors import MissingHeaderError, PayloadError
from astraflow.log.lag import OffsetLedger, compute_lag
from astraflow.log.offsets import ProcessedOffsets


def test_topic_names() -> None:
    t = Topics("run-7")
    assert t.tasks("math") == "run-7.tasks.math"
    assert t.trajectories == "run-7.trajectories"
    assert t.batches("pi_a") == "run-7.batches.pi_a"
    assert t.weights("pi_a") == "run-7.weights.pi_a"
    assert t.metrics == "run-7.metrics"
    assert t.dead_letters == "run-7.dead-letters"


@pytest.mark.parametrize("bad", ["", "a.b", "with space", "ünï", "-lead"])
def test_pool_and_policy_names_are_validated(bad: str) -> None:
    with pytest.raises(TopicNameError, match="illegal"):
        Topics("r").tasks(bad)
    with pytest.raises(TopicNameError):
        Topics("r").batches(bad)


def test_run_id_and_length_are_validated() -> None:
    with pytest.raises(TopicNameError, match="run id"):
        Topics("bad/run")
    with pytest.raises(TopicNameError, match="249"):
        Topics("r" * 240).tasks("pool-name-long")


def test_arrow_round_trip_keeps_types_and_values() -> None:
    table = pa.table({
        "episode": pa.array(["a", "b"]),
        "tokens": pa.array([[1, 2, 3], [4]], pa.list_(pa.int32())),
        "reward": pa.array([0.5, -1.0], pa.float32()),
    })
    value = ArrowCodec.encode_table(table)
    # The value is a plain Arrow IPC stream: pyarrow reads it with no AstraFlow code.
    assert pa.ipc.open_stream(bytes(value)).read_all().equals(table)
    assert ArrowCodec.decode_table(bytes(value)).equals(table)
    batch = table.to_batches()[0]
    assert ArrowCodec.decode_table(ArrowCodec.encode_table(batch)).equals(table)


def test_garbage_is_a_payload_error() -> None:
    with pytest.raises(PayloadError, match="not an Arrow IPC stream"):
        ArrowCodec.decode_table(b"\x00garbage")
    with pytest.raises(PayloadError, match="not a JSON"):
        ArrowCodec.decode_json(b"{nope")
    with pytest.raises(TypeError):
        ArrowCodec.encode_table({"a": [1]})  # type: ignore[arg-type]


def test_headers_round_trip_including_claim() -> None:
    meta = RecordMeta("trajectory", 3, "raas-1", ARROW_STREAM, policy="pi", claim_key="r/claims/ab",
                      claim_sha256="ab", claim_size=12)
    assert RecordMeta.from_headers(meta.to_headers()) == meta
    plain = RecordMeta("announcement", 1, "trainer", JSON)
    names = [h for h, _ in plain.to_headers()]
    assert names == ["schema", "schema-version", "producer", "content-type"]


def test_missing_and_malformed_headers() -> None:
    with pytest.raises(MissingHeaderError, match="schema-version"):
        RecordMeta.from_headers([("schema", b"x"), ("content-type", ARROW_STREAM.encode())])
    with pytest.raises(MissingHeaderError, match="not an integer"):
        RecordMeta.from_headers([("schema", b"x"), ("schema-version", b"v1"), ("content-type", JSON.encode())])
    with pytest.raises(PayloadError, match="content-type"):
        RecordMeta.from_headers([("schema", b"x"), ("schema-version", b"1"), ("content-type", b"text/csv")])


def test_schema_expectations() -> None:
    meta = RecordMeta("trajectory", 2, "raas-1", ARROW_STREAM)
    check_schema(meta, "r.trajectories", None)
    check_schema(meta, "r.trajectories", {"trajectory": 2})
    check_schema(meta, "r.trajectories", {"r.trajectories": 2})
    check_schema(meta, "r.trajectories", {"r.trajectories": ("trajectory", 2)})
    with pytest.raises(SchemaMismatchError, match=r"'trajectory' v2.*expects 'trajectory' v1"):
        check_schema(meta, "r.trajectories", {"trajectory": 1})
    with pytest.raises(SchemaMismatchError, match=r"expects 'batch' v2"):
        check_schema(meta, "r.trajectories", {"r.trajectories": ("batch", 2)})
    with pytest.raises(SchemaMismatchError, match="does not expect"):
        check_schema(meta, "r.trajectories", {"task": 1})


def test_commit_prefix_stops_at_first_unprocessed_record() -> None:
    po = ProcessedOffsets()
    tp = ("t", 0)
    for off in (5, 6, 8, 9):  # a gap (7) as after compaction / control records
        po.delivered(tp, off)
    assert po.processed(tp, 6) and po.processed(tp, 8)
    assert po.to_commit() == {}  # 5 not processed: nothing may be committed
    po.processed(tp, 5)
    assert po.to_commit() == {tp: 9}  # 5, 6, 8 done -> next to read is 9
    po.committed({tp: 9})
    assert po.to_commit() == {}
    assert not po.processed(("t", 1), 0)  # never delivered (revoked partition): ignored
    po.processed(tp, 9)
    assert po.to_commit() == {tp: 10}
    po.forget([tp])
    assert po.to_commit() == {}


def test_ledger_merge_and_lag() -> None:
    a, b = OffsetLedger(), OffsetLedger()
    for off in range(10):
        a.record("t", 0, off)
    b.record("t", 0, 10)
    b.record("t", 1, 3)
    a.merge(b.to_json())
    assert a.produced_end() == {("t", 0): 11, ("t", 1): 4}
    assert acked_count(a) == {("t", 0): 11, ("t", 1): 1}
    assert compute_lag(a.produced_end(), {("t", 0): 7}) == {("t", 0): 4, ("t", 1): 4}
    assert compute_lag(a.produced_end(), {("t", 0): 11, ("t", 1): 4}) == {("t", 0): 0, ("t", 1): 0}


def test_commit_during_a_broker_outage_stays_pending_and_is_retried() -> None:
    """A commit that fails because the broker is gone (or the group rebalanced) must not kill the
    component: the offsets stay pending and the next commit covers them (at-least-once)."""
    from kafka.errors import KafkaConnectionError, UnknownTopicOrPartitionError

    from astraflow.log.consumer import LogConsumer

    class Broker:
        def __init__(self) -> None:
            self.fail_with: Exception | None = KafkaConnectionError("connection refused")
            self.commits: list[dict] = []

        def commit(self, offsets: dict) -> None:
            if self.fail_with is not None:
                raise self.fail_with
            self.commits.append({(tp.topic, tp.partition): m.offset for tp, m in offsets.items()})

    consumer = object.__new__(LogConsumer)
    consumer._consumer, consumer._offsets, consumer._start_at = Broker(), ProcessedOffsets(), {}
    consumer._offsets.delivered(("t", 0), 5)
    consumer._offsets.processed(("t", 0), 5)
    assert consumer._commit_prefix(consumer._offsets.to_commit()) == {}
    consumer._consumer.fail_with = None
    assert consumer._commit_prefix(consumer._offsets.to_commit()) == {("t", 0): 6}
    assert consumer._consumer.commits == [{("t", 0): 6}]
    consumer._offsets.delivered(("t", 0), 6)
    consumer._offsets.processed(("t", 0), 6)
    consumer._consumer.fail_with = UnknownTopicOrPartitionError("not retriable here")
    consumer._consumer.fail_with.retriable = False
    with pytest.raises(UnknownTopicOrPartitionError):
        consumer._commit_prefix(consumer._offsets.to_commit())


def test_the_decoder_parses_each_header_set_once_and_never_mixes_them_up() -> None:
    """Records alternate between header sets: each message carries its own; a set the consumer does
    not expect is refused every time it comes, however often an accepted one came before it."""
    from collections import namedtuple

    from astraflow.config import ClusterConfig
    from astraflow.log.decoder import RecordDecoder

    Rec = namedtuple("Rec", "topic partition offset key value headers timestamp")
    value = bytes(ArrowCodec.encode_table(pa.table({"x": [1, 2]})))
    sets = {p: RecordMeta("trajectory", 1, f"node-{p}", ARROW_STREAM, policy=p).to_headers() for p in ("a", "b")}
    wrong = RecordMeta("trajectory", 2, "node-c", ARROW_STREAM, policy="c").to_headers()
    decoder = RecordDecoder(ClusterConfig(), {"trajectory": 1})
    for i, p in enumerate("abba" * 3):
        m = decoder.decode(Rec("r.trajectories", 0, i, b"k", value, sets[p], 0))
        assert (m.policy, m.producer, m.headers["policy"], m.offset) == (p, f"node-{p}", p, i)
        m.headers["policy"] = "mutated"  # a message's headers are its own
        with pytest.raises(SchemaMismatchError):
            decoder.decode(Rec("r.trajectories", 0, i, b"k", value, wrong, 0))


def test_a_record_names_a_policy_only_when_every_row_names_the_same_one() -> None:
    from astraflow.log.producer import record_policy

    assert record_policy(["solver", "solver"]) == "solver"
    assert record_policy(["solver", "verifier"]) is None
    assert record_policy(["", ""]) is None  # tasks whose workflow picks the policy
    assert record_policy([]) is None
