"""Claim check: a value above ``cfg.inline_limit_bytes`` goes to the bucket, the record carries a pointer.

Claims are content-addressed (``<run>/claims/<sha256>``), so writing the same payload twice is
harmless and a lost conditional put means the bytes are already there.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import TYPE_CHECKING

from astraflow.log.errors import ClaimCheckError

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.objstore import ObjectStore


class ClaimCheck:
    """Puts and fetches claim-checked payloads of one run. The store opens on first use, so a log
    user whose values all fit inline never needs the bucket."""

    def __init__(self, cfg: ClusterConfig, store: ObjectStore | None = None) -> None:
        self._cfg = cfg
        self._store = store
        self._layout = None

    def _open(self) -> tuple[ObjectStore, object]:
        if self._store is None:
            from astraflow.objstore.regional import open_reader

            # Claims are immutable (content-addressed): a node with a regional replica reads them there.
            self._store = open_reader(self._cfg)
        if self._layout is None:
            from astraflow.objstore import RunLayout

            self._layout = RunLayout(self._cfg.run)
        return self._store, self._layout

    def put(self, payload: bytes | memoryview) -> tuple[str, str]:
        """Store ``payload``; return (bucket key, sha256 hex)."""
        from astraflow.objstore.errors import ObjectExistsError

        store, layout = self._open()
        digest = hashlib.sha256(payload).hexdigest()
        key = layout.claim_key(digest)
        # The key is the digest, so the store is handed it rather than hashing the payload again.
        with contextlib.suppress(ObjectExistsError):  # same key = same sha256 = same bytes
            store.put_bytes(key, payload, if_none_match=True, sha256=digest)
        return key, digest

    def get(self, key: str, sha256: str, size: int | None = None) -> bytes:
        """Fetch a claim and check it against the pointer; :class:`ClaimCheckError` if it does not match.

        Other :class:`~astraflow.objstore.errors.ObjectStoreError`s (bucket unreachable) propagate:
        they are not the record's fault and must not send it to the dead letters.
        """
        from astraflow.objstore.errors import ChecksumError, ObjectNotFoundError

        store, _ = self._open()
        try:
            data, actual = store.get_bytes_with_sha256(key)
        except ObjectNotFoundError:
            raise ClaimCheckError(f"claim {key} is not in bucket {self._cfg.s3.bucket}") from None
        except ChecksumError as exc:
            raise ClaimCheckError(f"claim {key} is corrupt in the bucket: {exc}") from None
        if actual != sha256:
            raise ClaimCheckError(f"claim {key}: record says sha256 {sha256}, bucket bytes hash to {actual}")
        if size is not None and len(data) != size:
            raise ClaimCheckError(f"claim {key}: record says {size} bytes, bucket holds {len(data)}")
        return data
