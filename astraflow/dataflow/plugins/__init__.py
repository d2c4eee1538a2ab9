"""Dataflow plug-ins. Importing this package registers the built-in ones."""

from astraflow.dataflow.plugins import filters, samplers, selectors  # noqa: F401 - registration
from astraflow.dataflow.plugins.base import (
    BatchSampler,
    FilterSpec,
    Plugin,
    PluginError,
    PluginOptions,
    PluginSpec,
    SamplerSpec,
    SelectorSpec,
    TaskSelector,
    TrajectoryFilter,
    build_plugin,
    register_plugin,
    registered,
    validate_plugin,
)

__all__ = [
    "BatchSampler",
    "FilterSpec",
    "Plugin",
    "PluginError",
    "PluginOptions",
    "PluginSpec",
    "SamplerSpec",
    "SelectorSpec",
    "TaskSelector",
    "TrajectoryFilter",
    "build_plugin",
    "register_plugin",
    "registered",
    "validate_plugin",
]
