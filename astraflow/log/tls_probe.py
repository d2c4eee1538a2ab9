"""Why a broker refused a connection, when the cause is TLS: kafka-python only reports that no broker
answered, which sends a user after a dead server instead of a wrong credential.

Called after a client failed to connect (:func:`astraflow.log.admin.open_kafka_client`): one plain TLS
handshake with the client's own settings, then one ApiVersions request, since under TLS 1.3 a server
refuses a client certificate only after the handshake (an alert on the first read).
"""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astraflow.config import KafkaSettings

API_VERSIONS_V0 = b"\x00\x00\x00\x0a\x00\x12\x00\x00\x00\x00\x00\x01\xff\xff"
"""A whole ApiVersions v0 request (size, api key 18, version 0, correlation id 1, no client id)."""


def tls_refusal(kafka: KafkaSettings, timeout_s: float = 3.0) -> str | None:
    """The reason TLS keeps this client off the first bootstrap broker, in words, or None when TLS is
    not the cause (nothing listens, or the connection works)."""
    host, port = kafka.bootstrap.split(",")[0].rsplit(":", 1)
    where = f"the broker at {host}:{port}"
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError:
        return None
    with sock:
        if kafka.security_protocol in ("PLAINTEXT", "SASL_PLAINTEXT"):
            return f"{where} speaks TLS and this client does not: {_SET_SSL}" if _speaks_tls(sock, host) else None
        ctx = ssl.create_default_context(cafile=kafka.ssl_cafile)
        if kafka.ssl_certfile:
            ctx.load_cert_chain(kafka.ssl_certfile, kafka.ssl_keyfile)
        try:
            with ctx.wrap_socket(sock, server_hostname=host) as tls:
                tls.sendall(API_VERSIONS_V0)
                answered = tls.recv(4)
        except ssl.SSLCertVerificationError as exc:
            return f"{where} presented a certificate that kafka.ssl_cafile does not trust ({exc.verify_message})"
        except ssl.SSLError as exc:
            if not kafka.ssl_certfile:
                return (f"{where} requires a client certificate and this client has none ({exc.reason}): "
                        "set kafka.ssl_certfile / ssl_keyfile, or use the cluster's credential file")
            return (f"{where} refused this client's certificate ({exc.reason}): it is not signed by the "
                    "cluster's CA, or has expired")
        except OSError as exc:
            return f"{where} closed the TLS connection ({exc}): does it speak TLS?"
    return None if answered else f"{where} closed the connection after the TLS handshake"


_SET_SSL = ("set kafka.security_protocol to SSL with the cluster's CA and a client certificate "
            "(a credential file from `astraflow credentials issue`)")


def _speaks_tls(sock: socket.socket, host: str) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with ctx.wrap_socket(sock, server_hostname=host):
            return True
    except (ssl.SSLError, OSError):
        return False
