"""Reading an archive straight from the bucket with DuckDB, polars or pandas (``pip install astraflow[archive]``).

These helpers only turn a cluster config's S3 settings into each library's own options; the
snippets in docs/archive.md do the same by hand.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig


def archive_url(cfg: ClusterConfig, kind: str, pattern: str = "**/*.parquet") -> str:
    """``s3://<bucket>/<run>/archive/kind=<kind>/**/*.parquet``."""
    from astraflow.objstore import RunLayout

    return f"s3://{cfg.s3.bucket}/{RunLayout(cfg.run).archive_prefix(kind)}{pattern}"


def polars_storage_options(cfg: ClusterConfig) -> dict[str, str]:
    """``storage_options`` for ``polars.scan_parquet("s3://...")`` on ``cfg.s3`` (any endpoint).

    With ``s3.ca_file`` (a secured cluster's own CA), this also points ``SSL_CERT_FILE`` of this process at
    a bundle of the trusted roots it had and that CA: polars' object store takes no CA option, and reads its
    roots from that variable (rustls' native roots) when it builds a client."""
    s3 = cfg.s3
    opts = {"aws_access_key_id": s3.access_key or "", "aws_secret_access_key": s3.secret_key or "",
            "aws_region": s3.region}
    if s3.endpoint:
        opts["aws_endpoint_url"] = s3.endpoint
        opts["aws_allow_http"] = str(s3.endpoint.startswith("http://")).lower()
    if s3.ca_file:
        os.environ["SSL_CERT_FILE"] = str(_roots_with(Path(s3.ca_file)))
    return opts


def _roots_with(ca_file: Path) -> Path:
    """A PEM bundle beside ``ca_file``: the roots this process trusts (``SSL_CERT_FILE``, else OpenSSL's
    default file) and ``ca_file``'s certificate, so that other endpoints stay trusted."""
    import hashlib
    import ssl

    trusted = os.environ.get("SSL_CERT_FILE") or ssl.get_default_verify_paths().openssl_cafile
    roots = Path(trusted).read_text() if trusted and Path(trusted).is_file() else ""
    ca = ca_file.read_text()
    if ca in roots:  # already the bundle (a second call)
        return Path(trusted)
    bundle = roots.rstrip("\n") + "\n" + ca
    path = ca_file.with_name(f"roots-{hashlib.sha256(bundle.encode()).hexdigest()[:16]}.pem")
    if not path.exists():
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(bundle)
        tmp.replace(path)
    return path


def _httpfs_directory() -> str | None:
    """The extension directory of the ``duckdb-ext-httpfs`` wheel, if installed (no download)."""
    spec = importlib.util.find_spec("duckdb_ext")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        if any(Path(loc, "extensions").glob("*/*/httpfs.duckdb_extension")):
            return str(Path(loc, "extensions"))
    return None


def duckdb_connect(cfg: ClusterConfig, database: str = ":memory:") -> Any:
    """A DuckDB connection with ``httpfs`` loaded (from the wheel when installed, else DuckDB's own
    extension directory) and an S3 secret for ``cfg.s3``; with ``s3.ca_file``, server certificates are
    verified against it."""
    import duckdb

    con = duckdb.connect(database)
    directory = _httpfs_directory()
    if directory is not None:
        con.execute(f"SET extension_directory = '{directory}'")
    con.execute("LOAD httpfs")
    s3 = cfg.s3
    if s3.ca_file:  # DuckDB does not verify a server's certificate unless told to
        con.execute("SET enable_server_cert_verification = true")
        con.execute("SET ca_cert_file = ?", [s3.ca_file])
    parts = [f"TYPE s3, KEY_ID '{s3.access_key or ''}', SECRET '{s3.secret_key or ''}', REGION '{s3.region}'"]
    if s3.endpoint:
        url = urlparse(s3.endpoint)
        parts.append(f"ENDPOINT '{url.netloc}', URL_STYLE 'path', USE_SSL {str(url.scheme == 'https').lower()}")
    con.execute(f"CREATE OR REPLACE SECRET astraflow_s3 ({', '.join(parts)})")
    return con
