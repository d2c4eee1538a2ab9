"""Reading a producer's :class:`~astraflow.log.OffsetLedger` the way its readers do: through its JSON
form (the one published on ``<run>.metrics``)."""

from __future__ import annotations

from astraflow.log import OffsetLedger
from astraflow.log.lag import Partition


def acked_count(ledger: OffsetLedger) -> dict[Partition, int]:
    """(topic, partition) -> number of acknowledged records."""
    return {(topic, int(p)): n for topic, parts in ledger.to_json()["count"].items() for p, n in parts.items()}
