"""Dataflow plug-ins. Importing this package registers the built-in ones."""

from astraflow.dataflow.plugins import filters, samplers, selectors  # noqa: F401 - registration
from astraflow.dataflow.plugins.base import (
    BatchSampler,
    Plugin,
    PluginError,
    PluginOptions,
    PluginSpec,
    TaskSelector,
    TrajectoryFilter,
    build_plugin,
    register_plugin,
    registered,
)

__all__ = [
    "BatchSampler",
    "Plugin",
    "PluginError",
    "PluginOptions",
    "PluginSpec",
    "TaskSelector",
    "TrajectoryFilter",
    "build_plugin",
    "register_plugin",
    "registered",
]
