"""The episode ids the trajectory processor remembers to drop copies, bounded by what is in flight.

Why: trajectories arrive at least once, and a copy must not be trained twice. Until issue 28 every
episode id went into one FIFO of ``dedup_capacity`` (200,000) ids that was saved with the dataflow's
state: 4.7 KB more state per batch in the math recipe's shape, 7.4 MB after 1,713 steps, rewritten
at every save. Yet only the tasks still in flight can train anything: the processor drops a
trajectory whose task is not in flight (``unknown_task``) before it looks at its episode. So:

* the episodes of a task in flight are all remembered until the task leaves flight (finished or
  expired): a copy of them is always a ``duplicate``, however long the task runs;
* then those of the last ``window`` tasks to leave flight: a late copy (a node re-ran a task whose
  trajectories it had sent, the lost life's batches read again after a restart) is still counted
  ``duplicate``. A copy later than that is dropped and counted all the same, as ``unknown_task``;
* the episodes of tasks the dataflow does not track in flight (an archive replay, where the
  processor takes every task as known) go into a FIFO of ``capacity`` ids, oldest forgotten first,
  as before.

``capacity`` also bounds the ids of the ``window`` tasks; the in-flight ones are never forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


def task_of_episode(episode_id: str) -> str:
    """The task id in an ``episode_id_for(prompt_id, policy, i)`` id (``prompt_id/policy/i``)."""
    return episode_id.rsplit("/", 2)[0]


class EpisodeMemory:
    def __init__(self, *, in_flight: Callable[[str], bool], window: int, capacity: int) -> None:
        """``in_flight(task_id)``: whether the dataflow tracks that task as in flight (its
        :meth:`task_left` follows when it no longer is)."""
        self.in_flight = in_flight
        self.window = window
        self.capacity = capacity
        self.flying: dict[str, list[str]] = {}
        """Task id -> its episodes seen, for the tasks in flight."""
        self.recent: OrderedDict[str, list[str]] = OrderedDict()
        """Task id -> its episodes seen, for the last ``window`` tasks to leave flight, oldest first."""
        self.recent_episodes = 0
        self.untracked: OrderedDict[str, None] = OrderedDict()
        """Episodes of tasks not tracked in flight, oldest first."""

    def __len__(self) -> int:
        return sum(map(len, self.flying.values())) + self.recent_episodes + len(self.untracked)

    def seen(self, task_id: str, episode_id: str) -> bool:
        return (episode_id in self.flying.get(task_id, ()) or episode_id in self.recent.get(task_id, ())
                or episode_id in self.untracked)

    def remember(self, task_id: str, episode_id: str) -> None:
        """Remember ``episode_id`` of ``task_id`` (not seen yet)."""
        if self.in_flight(task_id):
            self.flying.setdefault(task_id, []).append(episode_id)
            return
        self.untracked[episode_id] = None
        if len(self.untracked) > self.capacity:
            self.untracked.popitem(last=False)

    def task_left(self, task_id: str) -> None:
        """``task_id`` left flight (finished or expired): its episodes join the window of recent tasks."""
        episodes = self.flying.pop(task_id, None)
        if not episodes:
            return
        if task_id in self.recent:  # a dataset that repeats a prompt id: it left flight before
            self.recent[task_id].extend(episodes)
            self.recent.move_to_end(task_id)
        else:
            self.recent[task_id] = episodes
        self.recent_episodes += len(episodes)
        self._trim()

    def _trim(self) -> None:
        while len(self.recent) > self.window:
            self.recent_episodes -= len(self.recent.popitem(last=False)[1])
        while self.recent_episodes > self.capacity:  # oldest episodes first, one at a time
            task_id, episodes = next(iter(self.recent.items()))
            episodes.pop(0)
            self.recent_episodes -= 1
            if not episodes:
                del self.recent[task_id]

    def state_dict(self) -> dict[str, Any]:
        return {"in_flight": dict(self.flying), "recent": list(self.recent.items()), "untracked": list(self.untracked)}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.flying = {t: list(e) for t, e in s["in_flight"].items()}
        self.recent = OrderedDict((t, list(e)) for t, e in s["recent"])
        self.recent_episodes = sum(map(len, self.recent.values()))
        self.untracked = OrderedDict.fromkeys(s["untracked"])
        self._trim()

    def load_flat(self, episodes: list[str]) -> None:
        """A state saved before this memory (one FIFO of every episode id, oldest first): the
        episodes of tasks in flight are kept as such, the others go to the window of recent tasks
        (as if their tasks had left flight in that order)."""
        self.flying, self.recent, self.recent_episodes, self.untracked = {}, OrderedDict(), 0, OrderedDict()
        for e in episodes:
            task_id = task_of_episode(e)
            if self.in_flight(task_id):
                self.flying.setdefault(task_id, []).append(e)
            else:
                self.recent.setdefault(task_id, []).append(e)
                self.recent.move_to_end(task_id)
                self.recent_episodes += 1
        self._trim()
