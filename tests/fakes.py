"""Shared test doubles: one model stand-in (:class:`FakeEngine`) and one trajectory builder
(:func:`make_trajectory`). Only the model is faked here; Kafka and S3 are always the real
embedded servers (``conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.engines.batching import RequestBatcher
from astraflow.engines.weight_update import FullState, InPlacePatch, UpdateRefusedError, WeightUpdate
from astraflow.records import Trajectory, episode_id_for, group_id_for

Reply = Generation | tuple[list[int], list[int]]
"""What a reply function returns for one prompt: a finished :class:`Generation` (used as is), or
the token ids of the turn and the weight version of each token (see :class:`FakeEngine`)."""


def generation(ids: list[int], version: int, logprob: float = -0.5) -> Generation:
    """A finished ("stop") continuation of ``ids``, every token at ``version`` with ``logprob``."""
    return Generation(list(ids), [logprob] * len(ids), [version] * len(ids), "stop")


class FakeEngine(Engine):
    """A test double for a model: answers each prompt with ``reply(prompt_ids, k)``, ``k`` counting
    the prompts this engine has answered so far (0 for the first), and records what it was given.

    A reply given as ``(ids, versions)`` is treated like sampling: clipped to the request's
    ``max_new_tokens``, finished "stop" when its last token is ``stop`` (else "length"), the
    log-prob of its k-th token ``-(k+1)/10``. ``batch=True`` merges concurrent ``agenerate``
    requests with astraflow's :class:`RequestBatcher`, as the HF engine does, so concurrent
    episodes show up in :attr:`batches`. Weights start at ``version``; the engine accepts the weight
    update kinds in ``accepts`` (none by default: the weights stay fixed), records each update in
    :attr:`updates` and takes its version; a full state is kept (copied) and served by ``state_dict``,
    which an in-place patch writes; a published version is taken as fetched.
    """

    def __init__(self, reply: Callable[[list[int], int], Reply] = lambda prompt, k: ([], []), *, version: int = 0,
                 stop: int | None = None, batch: bool = False, accepts: frozenset[type[WeightUpdate]] = frozenset()
                 ) -> None:
        self.reply, self.version, self.stop = reply, version, stop
        self.accepted_updates = frozenset(accepts)
        self.updates: list[WeightUpdate] = []
        """Every weight update applied, in order."""
        self._state: dict[str, Any] = {}
        self.prompts: list[list[int]] = []
        """Every prompt answered, in order."""
        self.params: list[SamplingParams] = []
        """The sampling params of each prompt in :attr:`prompts`."""
        self.requests: list[list[list[int]]] = []
        """The prompts of each ``generate`` call."""
        self._batcher = RequestBatcher(self, max_batch_size=64) if batch else None

    @property
    def batches(self) -> list[int]:
        """How many prompts each ``generate`` call decoded together."""
        return [len(r) for r in self.requests]

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self._batcher is None:
            return await super().agenerate(prompts, params)
        return await self._batcher.submit(prompts, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.requests.append([list(p) for p in prompts])
        out = []
        for p in prompts:
            k = len(self.prompts)
            self.prompts.append(list(p))
            self.params.append(params)
            r = self.reply(list(p), k)
            out.append(r if isinstance(r, Generation) else self._sampled(*r, params))
        return out

    def _sampled(self, ids: list[int], versions: list[int], params: SamplingParams) -> Generation:
        ids = list(ids[: params.max_new_tokens])
        versions = list(versions[: len(ids)])
        finish = "stop" if ids and ids[-1] == self.stop else "length"
        return Generation(ids, [-(k + 1) / 10 for k in range(len(ids))], versions, finish)

    def update_weights(self, update: WeightUpdate) -> None:
        if type(update) not in self.accepted_updates:
            raise UpdateRefusedError(self, type(update))
        if isinstance(update, FullState):
            # copies, as a real engine loads into tensors of its own
            self._state = {k: v.clone() if hasattr(v, "clone") else v for k, v in update.state_dict.items()}
        elif isinstance(update, InPlacePatch):
            update.write(self._state)
        self.updates.append(update)
        self.version = update.version

    @property
    def weight_version(self) -> int:
        return self.version

    def state_dict(self) -> dict[str, Any]:
        return self._state


def make_trajectory(task: str = "p1", policy: str = "policy", i: int = 0, *, n: int = 4,
                    version: int | None = None, reward: float = 1.0, **fields: Any) -> Trajectory:
    """A valid trajectory of sample ``i`` of prompt ``task`` by ``policy``: prompt ``[1, 2, 3]``,
    ``n`` response tokens ``10, 11, ...`` at log-prob -0.5, all trained (loss mask 1). Versions:
    every token at ``version`` when given, else decoded at v3 with the last token at v4 (weights
    swapped mid-sequence). Any other field, ids included, by keyword (``loss_mask`` stays ``n`` long
    unless given)."""
    base: dict[str, Any] = {
        "episode_id": episode_id_for(task, policy, i), "task_id": task, "group_id": group_id_for(task, policy),
        "sample_index": i, "policy": policy, "prompt_ids": [1, 2, 3], "response_ids": list(range(10, 10 + n)),
        "logprobs": [-0.5] * n, "versions": [3] * (n - 1) + [4] if version is None else [version] * n,
        "loss_mask": [1] * n, "reward": reward,
    }
    return Trajectory(**{**base, **fields})
