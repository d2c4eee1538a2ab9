"""Environments an agent acts in over several turns (see :mod:`astraflow.environments.base`).

Importing this package registers the built-ins by name: ``http`` (an environment server speaking
the start / step / cancel protocol). A user's environment registers itself the same way, with
:func:`register_environment`, when its module is imported.
"""

from astraflow.environments.base import (
    ENVIRONMENTS,
    Environment,
    EnvironmentConfig,
    EnvironmentFailure,
    EnvironmentField,
    EnvStart,
    EnvStep,
    build_environment,
    register_environment,
)
from astraflow.environments.http import HttpEnvironment

__all__ = [
    "ENVIRONMENTS",
    "EnvStart",
    "EnvStep",
    "Environment",
    "EnvironmentConfig",
    "EnvironmentFailure",
    "EnvironmentField",
    "HttpEnvironment",
    "build_environment",
    "register_environment",
]
