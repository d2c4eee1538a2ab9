"""When a dead component is started again: exponential backoff inside a restart budget.

The contract is the one a Kubernetes Deployment (CrashLoopBackOff) or a systemd unit with
``Restart=on-failure`` + ``StartLimitBurst``/``StartLimitIntervalSec`` gives: a component that dies
is restarted after a delay that doubles with each recent restart, up to a cap; one that dies more
than ``max_restarts`` times within ``window_s`` is given up on, and the run fails. Restarting is
safe because every component is stateless (committed offsets in the log, state in the bucket).

Pure bookkeeping, no processes or clocks of its own (times are passed in), so it is tested alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    """How eagerly and how often a component is restarted."""

    backoff_initial_s: float = 1.0
    """Delay before the first restart within the window."""
    backoff_max_s: float = 30.0
    """Cap of the doubling delay."""
    max_restarts: int = 5
    """Restarts allowed within ``window_s``; the next death fails the run. 0: never restart."""
    window_s: float = 600.0
    """Sliding window of the budget; restarts older than this are forgotten (and so is the backoff)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_initial_s < 0 \
                or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"invalid restart policy {self}")

    def delay(self, recent: int) -> float:
        """Backoff before a restart when ``recent`` restarts already happened within the window."""
        return min(self.backoff_initial_s * 2.0 ** recent, self.backoff_max_s)


NO_RESTART = RestartPolicy(max_restarts=0)
"""A component that dies fails the run at once (the launcher's behaviour before supervision)."""


@dataclass
class RestartBook:
    """The restart history of one component under a :class:`RestartPolicy`."""

    policy: RestartPolicy
    restarts: int = 0
    """Restarts over the whole run (shown to the user; the budget counts only the window)."""
    _recent: deque[float] = field(default_factory=deque)

    def recent(self, now: float) -> int:
        """Restarts within the policy's window before ``now``."""
        while self._recent and now - self._recent[0] >= self.policy.window_s:
            self._recent.popleft()
        return len(self._recent)

    def on_exit(self, now: float) -> float | None:
        """The component died at ``now``: seconds to wait before restarting it, or None when the
        budget is exhausted (the run fails). Counts the restart as granted."""
        recent = self.recent(now)
        if recent >= self.policy.max_restarts:
            return None
        delay = self.policy.delay(recent)
        self._recent.append(now)
        self.restarts += 1
        return delay
