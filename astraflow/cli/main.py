"""Entry point of ``astraflow``: builds the parser from the command modules, then dispatches.

A command module exposes ``register(subparsers) -> None``, which adds its parser(s) and sets
``func=<callable(args) -> int>`` as a default. Modules import heavy libraries (torch, boto3,
kafka) inside their ``func`` only, so ``astraflow --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from astraflow import __version__
from astraflow.config import ConfigError

# Order here is the order in ``--help``.
COMMAND_MODULES = [
    "astraflow.cli.stack",      # up, down, status
    "astraflow.cli.credentials", # credentials issue
    "astraflow.cli.weights",    # weights ls|show|verify|gc
    "astraflow.cli.components", # raas, dataflow, trainer
    "astraflow.cli.run",        # run RECIPE, demo
    "astraflow.cli.archive",    # archive
    "astraflow.cli.sinks",      # sinks
    "astraflow.cli.replay",     # replay RUN
    "astraflow.cli.runs",       # runs ls|show
    "astraflow.cli.deploy",     # deploy k8s|topics
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="astraflow",
        description="Asynchronous multi-policy RL for agentic LLMs on a log (Kafka) and a bucket (S3).",
    )
    parser.add_argument("--version", action="version", version=f"astraflow {__version__}")
    parser.add_argument(
        "--config", metavar="YAML", help="cluster config file (default: $ASTRAFLOW_CONFIG or the embedded stack)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"astraflow: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not is_known_condition(exc):
            raise  # a bug: its traceback is the report
        print(f"astraflow {args.command}: {exc}", file=sys.stderr)
        return 1


def is_known_condition(exc: BaseException) -> bool:
    """An error that names a condition of the cluster or its data (an endpoint that does not answer,
    a refused credential, a missing object or version, a broker away, a stack that cannot start):
    its message is the whole answer, its traceback noise."""
    from astraflow.delta.errors import DeltaError, WeightStoreError
    from astraflow.embedded import StackError
    from astraflow.log.errors import LogError
    from astraflow.objstore.errors import ObjectStoreError

    known: tuple[type[BaseException], ...] = (ObjectStoreError, LogError, WeightStoreError, DeltaError, StackError)
    if "kafka" in sys.modules:  # only a command that used the broker can have raised one of its errors
        from kafka.errors import KafkaError

        known += (KafkaError,)
    return isinstance(exc, known)


if __name__ == "__main__":
    sys.exit(main())
