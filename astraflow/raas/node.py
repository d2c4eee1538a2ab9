"""The RaaS node process: consume tasks, produce trajectories, refresh weights.

Life of a task record (one Arrow table of Task rows on ``<run>.tasks.<pool>``):

1. polled by this node as a member of group ``<run>.raas.<pool>``;
2. each row runs as one ``workflow.run_episode`` coroutine; about ``pool.concurrency`` rows run at
   once, fewer than one record's rows more at most (the consumer is paused, but still polled, while
   the node is full, so it stays in the group);
3. the episode's trajectories (``node_id`` set) are produced to ``<run>.trajectories`` in one record
   with those of the other episodes that finished in the same turn of the event loop
   (:class:`~astraflow.raas.outbox.TrajectoryOutbox`), and the node waits for the broker's acknowledgement;
4. when every row of the record is acknowledged (or rejected: the workflow returned None, or it
   raised), the record is handed to ``LogConsumer.commit`` with the next poll (one commit for every
   record finished since the last), which commits only the contiguous processed prefix of the partition.

A clean stop (SIGTERM: the launcher stopping a run or its actuator scaling the pool down) drains the
node: it polls no new task, lets its running episodes finish for up to ``drain_timeout_s`` (the pool's
``drain_timeout_s``), commits what finished, and leaves the group; an episode still running then is
cancelled uncommitted, so the group hands its task to another member.

So a SIGKILL at any point loses nothing: whatever was not committed is re-delivered to another member
of the group, and duplicated trajectories carry the same deterministic episode ids for the dataflow to
drop. All Kafka consumer calls run on one dedicated thread (the client is not thread-safe); generation
runs on worker threads (``Engine.agenerate``); kafka-python heartbeats on its own thread, and
``max_poll_interval_ms`` is generous because a slow poll loop, not generation, is what it guards.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astraflow.engines.seeding import mix
from astraflow.log import ConsumerGroups, LogConsumer, LogProducer, Topics
from astraflow.log.errors import ProduceRefusedError
from astraflow.raas.inflight import InFlightTasks
from astraflow.raas.metrics import NodeCounters
from astraflow.records.control import NodeStatus, send_control
from astraflow.workflows.seeding import seeded_episode

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.raas.outbox import TrajectoryOutbox
    from astraflow.raas.weights import WeightFollower
    from astraflow.recipe import PoolSpec, Recipe
    from astraflow.workflows import Workflow
    from astraflow.workflows.policy import PolicyClient

log = logging.getLogger(__name__)
EXIT_PRODUCER_FAILED = 75
"""Exit status of a node whose producer failed (EX_TEMPFAIL): the supervisor restarts it."""


@dataclass
class NodeParts:
    """What a node works with: built from the recipe by :meth:`RaasNode.from_config`."""

    workflow: Workflow
    """Runs an episode of a task."""
    policies: dict[str, PolicyClient]
    """Policy name -> its client (engine, tokenizer, sampling)."""
    follower: WeightFollower
    """Keeps each policy's engine on the newest published weights."""
    producer: LogProducer
    """Sends trajectories and the node's status."""
    outbox: TrajectoryOutbox
    """Batches the trajectories of episodes that finish together into one record."""


class RaasNode:
    def __init__(self, cfg: ClusterConfig, pool: PoolSpec, node_id: str, parts: NodeParts,
                 stop_event: threading.Event, *, metrics_every_s: float = 5.0,
                 weights_timeout_s: float = 600.0, drain_timeout_s: float = 30.0, sampling_seed: int = 0) -> None:
        self.cfg = cfg
        self.pool = pool
        self.node_id = node_id
        self.workflow, self.policies, self.follower = parts.workflow, parts.policies, parts.follower
        self.producer, self.outbox = parts.producer, parts.outbox
        self.engines = {name: client.engine for name, client in self.policies.items()}
        self.stop_event = stop_event
        self.metrics_every_s = metrics_every_s
        self.weights_timeout_s = weights_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.sampling_seed = sampling_seed
        """Each episode's sampling is seeded from this and its task id (:mod:`astraflow.workflows.seeding`)."""
        self.topics = Topics(cfg.run)
        self.counters = NodeCounters(node_id, pool.name)
        self.inflight: InFlightTasks[Any] = InFlightTasks()
        self._finished: list[Any] = []
        """Task records whose every task is done, committed with the next poll (one commit for all)."""
        self._consumer: LogConsumer | None = None
        """The task consumer, once the node has joined its pool's group."""

    @classmethod
    def from_config(cls, cfg: ClusterConfig, recipe: Recipe, pool: str, node_id: str,
                    stop_event: threading.Event, **options: Any) -> RaasNode:
        """A node of ``pool`` with the parts the recipe names; the run's topics exist when it returns."""
        from astraflow.log.admin import ensure_run_topics
        from astraflow.raas.outbox import TrajectoryOutbox
        from astraflow.raas.setup import build_policy_clients, build_recipe_workflow
        from astraflow.raas.weights import WeightFollower

        spec, topics = recipe.pool(pool), Topics(cfg.run)
        # A node started on its own (not by `astraflow run`) may be the first: the run's topics as the
        # launcher would create them, this pool at its configured size.
        ensure_run_topics(cfg, {spec.name: spec.nodes}, [p.name for p in recipe.policies])
        policies = build_policy_clients(recipe, spec, node_id)
        producer = LogProducer(cfg, f"{cfg.run}.raas.{node_id}")
        parts = NodeParts(workflow=build_recipe_workflow(recipe), policies=policies,
                          follower=WeightFollower(cfg, {n: c.engine for n, c in policies.items()}, node_id),
                          producer=producer, outbox=TrajectoryOutbox(producer, topics.trajectories))
        return cls(cfg, spec, node_id, parts, stop_event, sampling_seed=mix(recipe.seed, spec.engine.seed), **options)

    def run(self) -> NodeCounters:
        """Serve until ``stop_event`` is set; returns the final counters."""
        return asyncio.run(self._run())

    async def _run(self) -> NodeCounters:
        from astraflow.records import task as task_rec

        topics = self.topics
        loop = asyncio.get_running_loop()
        self._weights_served = asyncio.Event()
        self.follower.on_served(functools.partial(loop.call_soon_threadsafe, self._weights_served.set))
        self._consumer_thread = ThreadPoolExecutor(1, thread_name_prefix=f"tasks-{self.node_id}")
        consumer = None
        try:
            # Catch up before joining the task group: a member that holds partitions but cannot work
            # would only delay the tasks that another node could run now.
            versions = await asyncio.to_thread(self.follower.catch_up, self.weights_timeout_s, self.stop_event)
            log.info("node %s: serving %s", self.node_id, versions)
            # Announce the node (pool, versions served) as soon as it can work, not only every
            # metrics_every_s: short runs and autoscaling both want to see every member.
            send_control(self.producer, topics.metrics, self.node_id, self._status())
            self.follower.start()
            group = ConsumerGroups(self.cfg.run).raas(self.pool.name)
            consumer = await loop.run_in_executor(self._consumer_thread, functools.partial(
                LogConsumer, self.cfg, topics.tasks(self.pool.name), group,
                {task_rec.SCHEMA_NAME: task_rec.SCHEMA_VERSION}, max_poll_interval_ms=300_000,
                client_id=f"raas-{self.node_id}"))
            self._consumer = consumer
            await self._serve(topics, consumer)
            finished, self._finished = self._finished, []
            await self._on_consumer(consumer.commit, finished)
            # A commit refused during the drain (the group rebalancing as nodes come and go) has no
            # next commit to cover it: retry it, or the finished tasks would all be run again.
            await self._on_consumer(consumer.commit_pending)
        finally:
            self.follower.stop()
            if consumer is not None:
                await loop.run_in_executor(self._consumer_thread, consumer.close)
            send_control(self.producer, topics.metrics, self.node_id, self._status())
            self.producer.flush(10)
            self.producer.close()
            self._consumer_thread.shutdown(wait=True)
            log.info("node %s: stopped", self.node_id)
        return self.counters

    async def _on_consumer(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self._consumer_thread, functools.partial(fn, *args, **kwargs))

    async def _serve(self, topics: Any, consumer: Any) -> None:
        from astraflow.records import RecordSchemaError
        from astraflow.records import task as task_rec

        episodes: set[asyncio.Task] = set()
        last_metrics = time.monotonic()
        # A record may hold several tasks (the dataflow sends the tasks it emits together in one record
        # per partition): take as many records as the free slots hold at the last record's size, so
        # the slots are overrun by less than one record's tasks.
        rows_per_record = 1
        while not self.stop_event.is_set():
            self.follower.check()
            for ep in [e for e in episodes if e.done()]:
                episodes.discard(ep)
                ep.result()  # an episode's own failures are handled inside; this surfaces bugs
            free = self.pool.concurrency - self.inflight.tasks
            if free <= 0 and not consumer.paused:
                await self._on_consumer(consumer.pause)
            elif free > 0 and consumer.paused:
                await self._on_consumer(consumer.resume)
            # While paused the poll only keeps the group alive: a short one, so that a slot freed by
            # a finishing episode resumes fetching within ~20 ms instead of after the full wait.
            finished, self._finished = self._finished, []
            msgs = await self._on_consumer(_commit_then_poll, consumer, finished,
                                           timeout_s=0.02 if consumer.paused else 0.2,
                                           max_records=max(free // rows_per_record, 1))
            for msg in msgs:
                try:
                    if msg.table is None:
                        raise RecordSchemaError(f"not an Arrow task record (schema {msg.schema_name})")
                    tasks = task_rec.from_table(msg.table)
                except Exception as exc:  # noqa: BLE001 - bad input must not stop the node
                    log.error("node %s: skipping task record %s:%d@%d: %s", self.node_id, msg.topic,
                              msg.partition, msg.offset, exc)
                    self.counters.rejected += 1
                    self._finished.append(msg)
                    continue
                self.inflight.add(msg, len(tasks))
                rows_per_record = max(len(tasks), 1)
                if not tasks:
                    self._finished.append(msg)
                for t in tasks:
                    episodes.add(asyncio.create_task(self._episode(msg, t)))
            # No sleep when full: the paused consumer's poll waits out its timeout on the consumer thread
            # while episodes run on this loop, and a group rebalance that completes outside a poll is
            # dropped and started over by kafka-python 3.0 (one more round trip, ~3 s on Tansu).
            if time.monotonic() - last_metrics >= self.metrics_every_s:
                send_control(self.producer, topics.metrics, self.node_id, self._status())
                last_metrics = time.monotonic()
        # Clean stop: finish what runs (so it need not be redone), then leave the group.
        episodes = {e for e in episodes if not e.done()}
        log.info("node %s: stopping; draining %d running episodes (up to %g s)", self.node_id, len(episodes),
                 self.drain_timeout_s)
        if episodes:
            _done, pending = await asyncio.wait(episodes, timeout=self.drain_timeout_s)
            for ep in pending:
                ep.cancel()
            log.info("node %s: drained: %d episodes finished, %d handed back", self.node_id,
                     len(episodes) - len(pending), len(pending))

    async def _episode(self, msg: Any, task: Any) -> None:
        t0 = time.perf_counter()
        try:
            await self._await_weights(task)
            with seeded_episode(self.sampling_seed, task.prompt_id):
                trajs = await self.workflow.run_episode(task, self.policies)
            if trajs:
                for tr in trajs:
                    tr.node_id = self.node_id
                await self.outbox.send(task.prompt_id, trajs)  # acknowledged by the broker: now the task may be committed
                self.counters.episodes += 1
                self.counters.trajectories += len(trajs)
                self.counters.tokens += sum(int(sum(t.loss_mask)) for t in trajs)
            else:
                self.counters.rejected += 1  # the dataflow expires and counts a rejected task
        except asyncio.CancelledError:
            raise  # not committed: re-delivered to another node
        except ProduceRefusedError as exc:
            # The trajectories were not written and this producer may stay failed (a fatal broker
            # answer, e.g. while Tansu's bucket restarts): exit without committing, like a SIGKILL;
            # the supervisor restarts the node and the task is delivered again.
            log.error("node %s: %s; exiting to restart with a fresh producer", self.node_id, exc)
            os._exit(EXIT_PRODUCER_FAILED)
        except Exception:
            # Committed anyway: re-delivering a task that fails deterministically would block the
            # partition forever; the dataflow's task timeout counts it as expired.
            log.exception("node %s: episode of task %s failed", self.node_id, task.prompt_id)
            self.counters.rejected += 1
        finally:
            self.counters.busy_s += time.perf_counter() - t0
        ready = self.inflight.task_done(msg)
        if ready is not None:
            self._finished.append(ready)

    async def _await_weights(self, task: Any) -> None:
        """A task emitted for version v starts only once the engines it uses serve v or newer.

        The dataflow emits a task after it saw v announced; the follower may still be pulling v.
        Without this wait an episode could start on v-1, and sync mode (on-policy barrier) would
        train on stale tokens. In async mode it only orders a node's refresh before its next episode.
        """
        policies = [task.policy] if task.policy in self.engines else list(self.engines)
        deadline = time.monotonic() + self.weights_timeout_s
        while True:
            self._weights_served.clear()  # before the check: a version served after it sets it again
            if all(self.engines[p].weight_version >= task.emitted_version for p in policies):
                return
            self.follower.check()
            if self.stop_event.is_set():
                raise asyncio.CancelledError  # not committed: another node runs it on fresh weights
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.node_id}: weights v{task.emitted_version} of {policies} "
                                   f"not loaded within {self.weights_timeout_s:g} s")
            # Woken the moment the follower's refresh thread serves a version (no polling interval
            # between new weights and the episodes waiting for them); the timeout re-checks the rest.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._weights_served.wait(), timeout=0.1)

    def _policy_counters(self) -> dict[str, int]:
        """The policy clients' counters as ``<policy>.<counter>`` (``<policy>.regenerated``, ...); the
        status record puts them beside the workflow's."""
        return {f"{name}.{k}": v for name, client in self.policies.items() for k, v in client.counters.items()}

    def _status(self) -> NodeStatus:
        follower = self.follower
        handoff = {**(self._consumer.handoff.drain() if self._consumer is not None else {}),
                   **follower.serving.drain()}
        return self.counters.record(
            self.pool.concurrency, follower.versions, follower.refresh_s, self.inflight.tasks,
            {**self.workflow.counters, **self._policy_counters()}, follower.counters, handoff,
            follower.region_record(),
        )


def _commit_then_poll(consumer: Any, finished: list[Any], **poll: Any) -> list[Any]:
    """On the consumer's thread: commit the records finished since the last poll, then poll. One
    commit per poll instead of one per task record (a round trip each, on the broker and on this
    process's IO thread); a record waits at most one poll (0.2 s) longer to be committed, which only
    widens what a SIGKILL re-delivers."""
    if finished:
        consumer.commit(finished)
    return consumer.poll(**poll)


def run_raas_node(cfg: ClusterConfig, recipe: Recipe, pool: str, node_id: str,
                  stop_event: threading.Event, **options: Any) -> NodeCounters:
    """Run one RaaS node of ``pool`` until ``stop_event`` is set (see the module docstring)."""
    return RaasNode.from_config(cfg, recipe, pool, node_id, stop_event, **options).run()
