"""``ObjectStore``: the one S3 client every AstraFlow component uses.

Every object written through this layer carries the sha256 of its bytes in its user metadata
(``x-amz-meta-sha256``); every read through it recomputes the hash and refuses a mismatch with
:class:`ChecksumError`. S3's own ETag is not a content hash for multipart uploads, and the layer must
work the same on AWS, MinIO and SeaweedFS, hence a checksum of our own.

Retries: transient request failures (5xx, throttling, connection reset/refused, timeouts) are
retried by botocore (``retries.mode`` ``standard``, bounded attempts, exponential backoff with
jitter). botocore does not retry a response body that breaks while it is being read, so
:meth:`ObjectStore.get_bytes` retries that case itself, a bounded number of times. A checksum mismatch
is never retried: it is raised.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.objstore.errors import (
    ChecksumError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
)

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

SHA256_META = "sha256"
"""User-metadata field (``x-amz-meta-sha256``) holding the hex sha256 of the object's bytes."""

_HASH_BLOCK = 8 * 1024 * 1024
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_EXISTS_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"}
_UNAVAILABLE_CODES = {"ServiceUnavailable", "SlowDown", "InternalError", "RequestTimeout", "500", "502", "503", "504"}


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks (hashlib releases the GIL on large blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


class ObjectStore:
    """A bucket on an S3 endpoint, with checksummed puts/gets and clear errors.

    Build it with :meth:`from_config`; the constructor takes an existing boto3 client (tests, or a
    caller that needs special client settings).
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        endpoint: str,
        *,
        multipart_threshold: int = 16 * 1024 * 1024,
        multipart_chunksize: int = 8 * 1024 * 1024,
        max_concurrency: int = 8,
        body_read_attempts: int = 3,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.endpoint = endpoint
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.max_concurrency = max_concurrency
        self.body_read_attempts = body_read_attempts
        self.on_read: Callable[[int], None] | None = None
        """Told the bytes of every object body read (``get_*``), as they arrive where the transfer
        reports them: a progress bar's hook (``astraflow weights export``, ``replay``). May be called
        from the transfer's threads."""

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        cfg: ClusterConfig,
        *,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 3,
        retry_mode: str = "standard",
        check_bucket: bool = True,
        **transfer: Any,
    ) -> ObjectStore:
        """A store on ``cfg.s3`` (resolving the embedded stack's endpoint if none is set).

        ``max_attempts`` counts the first try; with ``standard`` retries and a 2 s connect timeout a
        dead endpoint is reported within a few seconds. ``check_bucket`` makes one HEAD on the bucket
        so a wrong endpoint, wrong credentials or a missing bucket fail here, by name, rather than at
        the first write. ``transfer`` goes to the constructor (``multipart_threshold``,
        ``multipart_chunksize``, ``max_concurrency``).
        """
        import boto3
        from botocore.config import Config

        if cfg.s3.endpoint is None:
            cfg = cfg.resolve()
        s3 = cfg.s3
        concurrency = int(transfer.get("max_concurrency", 8))
        config = Config(
            region_name=s3.region,
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"mode": retry_mode, "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max(10, concurrency * 2),
            # botocore >= 1.36 adds CRC trailers by default, which not every S3 server accepts; we
            # carry our own sha256, so only send checksums where the API demands them.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=s3.endpoint,
            aws_access_key_id=s3.access_key,
            aws_secret_access_key=s3.secret_key,
            verify=s3.ca_file or None,
            config=config,
        )
        store = cls(client, s3.bucket, s3.endpoint or "(AWS default endpoint)", **transfer)
        if check_bucket:
            store.check_bucket()
        return store

    def check_bucket(self) -> None:
        """Fail with a message naming the endpoint or the bucket if the bucket is not usable."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            code = _error_code(exc)
            if code in {"404", "NoSuchBucket", "NotFound"}:
                raise ObjectStoreError(
                    f"S3 bucket {self.bucket!r} does not exist on {self.endpoint} "
                    "(create it, or set s3.bucket / ASTRAFLOW_S3_BUCKET)"
                ) from exc
            raise self._translate(exc, "head_bucket", None) from exc

    # -- bytes -------------------------------------------------------------------------------
    def put_bytes(
        self,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        if_none_match: bool = False,
        content_type: str = "application/octet-stream",
        sha256: str | None = None,
    ) -> str:
        """Write ``data`` under ``key``; return its sha256 hex (also stored in the object metadata).

        With ``if_none_match`` the put is conditional (``If-None-Match: *``) and raises
        :class:`ObjectExistsError` if the key already exists. ``sha256``: the hex digest of
        ``data`` when the caller already computed it (a content-addressed key), so the bytes are
        not hashed twice; a wrong one is not silently kept, every verified read refuses it.
        """
        data = bytes(data)
        digest = sha256 or hashlib.sha256(data).hexdigest()
        if len(data) > self.multipart_threshold and not if_none_match:
            # Large in-memory objects (anchors) go up as parallel multipart, like files; a single
            # PUT is also capped at 5 GB. A conditional put stays one request: s3transfer cannot
            # make a multipart upload conditional.
            extra = {"Metadata": {SHA256_META: digest}, "ContentType": content_type}
            with self._errors("put", key):
                self.client.upload_fileobj(
                    io.BytesIO(data), self.bucket, key, ExtraArgs=extra, Config=self._transfer_config()
                )
            return digest
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Body": data,
            "Metadata": {SHA256_META: digest},
            "ContentType": content_type,
        }
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        with self._errors("put", key, conditional=if_none_match):
            self.client.put_object(**kwargs)
        return digest

    def get_bytes(self, key: str, *, verify: bool = True) -> bytes:
        """The object's bytes, after checking them against the sha256 stored at write time.

        Raises :class:`ObjectNotFoundError`, or :class:`ChecksumError` on a mismatch or on an object
        that carries no checksum (written around this layer); ``verify=False`` skips the check.
        """
        if verify:
            return self.get_bytes_with_sha256(key)[0]
        return self._read(key)[0]

    def get_bytes_with_sha256(self, key: str) -> tuple[bytes, str]:
        """The verified bytes (as :meth:`get_bytes`) and their sha256 hex, as :meth:`get_file` returns
        it: for a caller that also checks the bytes against a digest of its own (a manifest, a
        checkpoint pointer, a claim-check header) without hashing them a second time."""
        data, metadata = self._read(key)
        expected = metadata.get(SHA256_META)
        actual = hashlib.sha256(data).hexdigest()
        _check_sha256(key, expected, actual, "return")
        return data, actual

    def _read(self, key: str) -> tuple[bytes, dict[str, str]]:
        """The object's bytes and user metadata, unverified."""
        from botocore.exceptions import (
            ConnectionClosedError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        body_errors = (IncompleteReadError, ResponseStreamingError, ReadTimeoutError, ConnectionClosedError)
        for attempt in range(1, self.body_read_attempts + 1):
            with self._errors("get", key):
                resp = self.client.get_object(Bucket=self.bucket, Key=key)
            try:
                data = resp["Body"].read()
                if self.on_read is not None:
                    self.on_read(len(data))
                return data, resp.get("Metadata", {})
            except body_errors as exc:
                # botocore retries the request, not a body that breaks mid-read: retry the GET here.
                if attempt == self.body_read_attempts:
                    raise ObjectStoreUnavailableError(
                        f"S3 endpoint {self.endpoint}: reading {self.url(key)} failed after "
                        f"{attempt} attempts: {exc}"
                    ) from exc
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    # -- files (parallel multipart) ----------------------------------------------------------
    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.multipart_chunksize,
            max_concurrency=self.max_concurrency,
            use_threads=True,
        )

    def put_file(self, key: str, path: str | Path, *, content_type: str = "application/octet-stream") -> str:
        """Upload a file (parallel multipart above ``multipart_threshold``); return its sha256 hex.

        The hash is computed in one streaming pass before the upload starts, because S3 fixes an
        object's metadata when the multipart upload is created; that pass also warms the page
        cache the upload threads then read from.
        """
        path = Path(path)
        if not path.is_file():
            raise ObjectStoreError(f"cannot upload {path}: not a file")
        digest = sha256_file(path)
        extra = {"Metadata": {SHA256_META: digest}, "ContentType": content_type}
        with self._errors("put", key):
            self.client.upload_file(
                str(path), self.bucket, key, ExtraArgs=extra, Config=self._transfer_config()
            )
        return digest

    def get_file(self, key: str, path: str | Path, *, verify: bool = True) -> str:
        """Download ``key`` to ``path`` (parallel ranged GETs); return the verified sha256 hex.

        Writes to a temporary file next to ``path`` and renames it into place only after the
        checksum matched, so ``path`` never holds unverified or partial bytes.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._errors("head", key):
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        expected = head.get("Metadata", {}).get(SHA256_META)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
        os.close(fd)
        try:
            with self._errors("get", key):
                self.client.download_file(self.bucket, key, tmp, Config=self._transfer_config(),
                                          Callback=self.on_read)
            actual = sha256_file(tmp)
            if verify:
                _check_sha256(key, expected, actual, "keep")
            os.replace(tmp, path)
            return actual
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- JSON helpers (manifests) -------------------------------------------------------------
    def put_json(self, key: str, obj: Any, *, if_none_match: bool = False) -> str:
        """Write ``obj`` as canonical JSON (sorted keys); return the sha256 hex of the bytes."""
        data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
        return self.put_bytes(key, data, if_none_match=if_none_match, content_type="application/json")

    def get_json(self, key: str) -> Any:
        """Read and verify a JSON object written by :meth:`put_json`."""
        data = self.get_bytes(key)
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ObjectStoreError(f"{self.url(key)} is not valid JSON: {exc}") from exc

    # -- metadata and listing ----------------------------------------------------------------
    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def head(self, key: str) -> dict[str, Any]:
        """``{"size": int, "sha256": str | None, "etag": str}`` of an object."""
        with self._errors("head", key):
            resp = self.client.head_object(Bucket=self.bucket, Key=key)
        return {
            "size": int(resp["ContentLength"]),
            "sha256": resp.get("Metadata", {}).get(SHA256_META),
            "etag": resp.get("ETag", "").strip('"'),
        }

    def size(self, key: str) -> int:
        return self.head(key)["size"]

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error (S3 semantics)."""
        with self._errors("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete keys in batches of 1000; return how many were requested. Raises on any failure."""
        count = 0
        batch: list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) == 1000:
                count += self._delete_batch(batch)
                batch = []
        if batch:
            count += self._delete_batch(batch)
        return count

    def _delete_batch(self, keys: list[str]) -> int:
        with self._errors("delete", keys[0]):
            resp = self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
            )
        errors = resp.get("Errors") or []
        if errors:
            first = errors[0]
            raise ObjectStoreError(
                f"S3 refused to delete {len(errors)} of {len(keys)} objects in {self.bucket!r}, e.g. "
                f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
            )
        return len(keys)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[str]:
        """Every key under ``prefix``, in lexicographic order (paginated, lazily)."""
        for item in self.list_objects(prefix, page_size=page_size):
            yield item["Key"]

    def list_objects(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[dict[str, Any]]:
        """Every object under ``prefix`` as S3 lists it (``Key``, ``Size``, ``LastModified``, ...)."""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size}
        )
        with self._errors("list", prefix):
            for page in pages:
                yield from page.get("Contents", [])

    def get_tail(self, key: str, size: int) -> bytes:
        """The last ``size`` bytes of ``key`` (a ranged GET: e.g. a Parquet footer)."""
        with self._errors("get", key):
            return self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=-{size}")["Body"].read()

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def __repr__(self) -> str:
        return f"ObjectStore(endpoint={self.endpoint!r}, bucket={self.bucket!r})"

    # -- error translation --------------------------------------------------------------------
    @contextlib.contextmanager
    def _errors(self, op: str, key: str | None, *, conditional: bool = False) -> Iterator[None]:
        try:
            yield
        except ObjectStoreError:
            raise
        except Exception as exc:
            raise self._translate(exc, op, key, conditional=conditional) from exc

    def _translate(
        self, exc: BaseException, op: str, key: str | None, *, conditional: bool = False
    ) -> Exception:
        from botocore.exceptions import (
            ClientError,
            NoCredentialsError,
            ReadTimeoutError,
            SSLError,
        )
        from botocore.exceptions import (
            ConnectionError as BotoConnectionError,
        )

        where = self.url(key) if key is not None else f"s3://{self.bucket}"
        if isinstance(exc, SSLError):  # a certificate the CA bundle does not trust: no wait cures it
            return ObjectStoreError(f"TLS handshake with S3 endpoint {self.endpoint} failed ({op} {where}): {exc} "
                                    "(is s3.ca_file the CA that signed its certificate?)")
        if isinstance(exc, BotoConnectionError | ReadTimeoutError):
            return ObjectStoreUnavailableError(f"S3 endpoint {self.endpoint} unreachable ({op} {where}): {exc}")
        if isinstance(exc, NoCredentialsError):
            return ObjectStoreError(
                f"no S3 credentials for {self.endpoint}: set s3.access_key/s3.secret_key "
                "(ASTRAFLOW_S3_ACCESS_KEY / ASTRAFLOW_S3_SECRET_KEY)"
            )
        code = _error_code(exc)
        if code in _EXISTS_CODES and conditional and key is not None:
            return ObjectExistsError(key)
        if code in _NOT_FOUND_CODES and key is not None and op != "list":
            return ObjectNotFoundError(key, f"object not found: {where}")
        if code == "NoSuchBucket":
            return ObjectStoreError(f"S3 bucket {self.bucket!r} does not exist on {self.endpoint}")
        if code in _AUTH_CODES:
            return ObjectStoreError(
                f"S3 endpoint {self.endpoint} refused {op} {where} ({code}): check the credentials "
                "and the bucket policy"
            )
        if code in _UNAVAILABLE_CODES:
            return ObjectStoreUnavailableError(f"S3 {op} {where} on {self.endpoint}: try again later ({code})")
        if isinstance(exc, ClientError) or code is not None:
            return ObjectStoreError(f"S3 {op} {where} on {self.endpoint} failed ({code}): {exc}")
        return ObjectStoreError(f"S3 {op} {where} on {self.endpoint} failed: {type(exc).__name__}: {exc}")


def _check_sha256(key: str, expected: str | None, actual: str, refusing: str) -> None:
    """Raise :class:`ChecksumError` unless ``actual`` is the sha256 the object's metadata records;
    an object without one (written around this layer) is refused too. ``refusing``: what the caller
    would otherwise do with the bytes ("return", "keep"), for the message."""
    if expected is None:
        raise ChecksumError(
            key,
            None,
            actual,
            f"object {key} carries no sha256 metadata (written outside "
            f"astraflow.objstore?); refusing to {refusing} unverified bytes (pass verify=False)",
        )
    if actual != expected:
        raise ChecksumError(key, expected, actual)


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code of a ClientError, also when s3transfer wrapped it (S3UploadFailedError)."""
    from botocore.exceptions import ClientError

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ClientError):
            err = cur.response.get("Error", {})
            code = err.get("Code")
            if code:
                return str(code)
            status = cur.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return str(status) if status else None
        cur = cur.__cause__ or cur.__context__
    # s3transfer's S3UploadFailedError keeps only the text of the ClientError.
    text = str(exc)
    for code in ("NoSuchBucket", "PreconditionFailed", "AccessDenied", "InvalidAccessKeyId"):
        if f"({code})" in text:
            return code
    return None
