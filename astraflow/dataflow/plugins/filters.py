"""After-rollout plug-ins: which complete groups are worth training on."""

from __future__ import annotations

from astraflow.dataflow.plugins.base import PluginOptions, TrajectoryFilter, register_plugin
from astraflow.dataflow.plugins.group import Group
from astraflow.dataflow.plugins.selectors import zero_variance


@register_plugin("keep_all")
class KeepAll(TrajectoryFilter):
    def keep(self, group: Group) -> bool:
        return True


class DynamicSamplingOptions(PluginOptions):
    tolerance: float = 1e-9
    """Rewards closer than this count as equal."""


@register_plugin("dynamic_sampling")
class DynamicSampling(TrajectoryFilter):
    """DAPO dynamic sampling: drop a group whose rewards are all equal; its group-normalised
    advantages are all zero, so it carries no gradient and only dilutes the batch."""

    Options = DynamicSamplingOptions

    def keep(self, group: Group) -> bool:
        return not zero_variance(group.rewards, self.options.tolerance)
