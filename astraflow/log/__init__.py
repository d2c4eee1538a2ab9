"""The log: Kafka topics carrying Arrow record batches (see docs/record-format.md).

``Topics`` names a run's topics and ``ConsumerGroups`` its consumer groups, ``ensure_topics``
creates the topics, ``LogProducer`` writes Arrow tables / JSON control records (claim-checking large
ones into the bucket), ``LogConsumer`` reads them back at-least-once and dead-letters what it cannot
decode, ``OffsetLedger``/``compute_lag`` measure lag without trusting broker watermarks.
"""

from astraflow.log.admin import ensure_topics
from astraflow.log.codec import ArrowCodec, RecordMeta
from astraflow.log.consumer import LogConsumer
from astraflow.log.errors import (
    BrokerUnavailableError,
    ClaimCheckError,
    DecodeError,
    LogError,
    MissingHeaderError,
    OversizedRecordError,
    PayloadError,
    SchemaMismatchError,
    TopicNameError,
    TransientBrokerError,
)
from astraflow.log.groups import ConsumerGroups
from astraflow.log.lag import OffsetLedger, committed_offsets, compute_lag
from astraflow.log.message import Ack, Message
from astraflow.log.producer import LogProducer
from astraflow.log.retry import DEFAULT_DEADLINE_S, retry_transient
from astraflow.log.topics import Topics, validate_topic_name

__all__ = [
    "DEFAULT_DEADLINE_S",
    "Ack",
    "ArrowCodec",
    "BrokerUnavailableError",
    "ClaimCheckError",
    "ConsumerGroups",
    "DecodeError",
    "LogConsumer",
    "LogError",
    "LogProducer",
    "Message",
    "MissingHeaderError",
    "OffsetLedger",
    "OversizedRecordError",
    "PayloadError",
    "RecordMeta",
    "SchemaMismatchError",
    "TopicNameError",
    "Topics",
    "TransientBrokerError",
    "committed_offsets",
    "compute_lag",
    "ensure_topics",
    "retry_transient",
    "validate_topic_name",
]
