"""A real Kafka broker (Tansu) and a real S3 server (SeaweedFS) on loopback, no Docker needed."""

from astraflow.embedded.ports import StackPorts, port_is_free
from astraflow.embedded.stack import EmbeddedStack, ServiceStatus, StackError, UpResult

__all__ = ["EmbeddedStack", "ServiceStatus", "StackError", "StackPorts", "UpResult", "port_is_free"]
