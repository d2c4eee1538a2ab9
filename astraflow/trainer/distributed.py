"""A policy's trainer as a group of ranks on torch.distributed: the contract, and the group's set-up.

Launch (``trainer.ranks: N`` in the recipe). ``astraflow run`` starts the trainer of a policy as ONE
component: ``python -m torch.distributed.run --nproc-per-node N --max-restarts 0 --module
astraflow.cli.main ... trainer ...`` (:func:`astraflow.trainer.launch.rank_group_argv`). torch's
elastic agent starts the N worker processes with ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``MASTER_ADDR`` / ``MASTER_PORT`` set, and when any worker dies it stops the others and exits non-zero
(torchrun semantics); the run's supervisor then restarts the whole group, which resumes from the last
checkpoint. On a cluster the same worker command runs under torchrun's multi-node rendezvous
(``--nnodes``, ``--rdzv-backend c10d``, ``--rdzv-endpoint``) with nothing else changed. Each worker
calls :meth:`RankGroup.start`: gloo on CPU, NCCL on CUDA, the worker pinned to ``cuda:LOCAL_RANK``.

The contract, for every trainer backend (:class:`astraflow.trainer.base.TrainerBackend`) and for the
trainer service, when the world size is above 1 (with one rank nothing here applies):

* **Who reads the log.** Rank 0 (the *leader*) alone: it is the batch topic's one consumer-group
  member, admits or skips each batch record (duplicate, already checkpointed, invalid), and commits
  offsets, once per checkpoint, as a single-process trainer does. The others never touch Kafka.
* **Commands.** Every loop turn the leader broadcasts one :class:`Command` to all ranks
  (:meth:`RankGroup.broadcast_command`): ``TRAIN`` with the batch record's Arrow IPC bytes (every
  rank decodes the same batch), ``CHECKPOINT``, ``IDLE`` (nothing arrived within the poll timeout:
  the turn is also the group's heartbeat) or ``STOP``. All ranks therefore make the same collective
  calls in the same order, and a dead peer surfaces on the next turn as an error (gloo) or a timeout
  (NCCL) instead of a silent hang.
* **Collective backend calls** (every rank calls them, in the same order):
  ``step(trajectories)`` gets the WHOLE batch on every rank and splits the work itself (the torch
  backend: each rank trains its share of the rows under FSDP2, the loss normalised by the whole
  batch's tokens, so the summed gradient equals the single-rank one); it returns the same metrics on
  every rank (reduced over the group). ``state_dict()`` returns the full weights in HF names on the
  leader and ``{}`` on the others (the publishable state, bit-exact to what one rank would hold).
  ``load_state(model, optimizer)`` takes full HF-named state on the leader and ``{}``/None on the
  others (broadcast from rank 0). ``sharded_state()`` / ``load_sharded_state()`` (below).
* **Who publishes.** One weight version per step, whatever the world size. A backend whose ranks hold
  rows of every weight (``publishes_rows``: the torch backend's FSDP2 shards) publishes in parts:
  every rank encodes and uploads the delta (and anchor) of its own rows (``weight_rows()``, collective)
  beside the others, and the leader writes the manifest once every part is in (no gather;
  :mod:`astraflow.delta.parts`). Otherwise the leader publishes the gathered full state whole. The
  leader also writes every control record.
* **Checkpoints** go through torch.distributed.checkpoint (DCP): ``sharded_state()`` exposes the
  backend's model and optimizer state as a nested dict of tensors (DTensor shards on a group) plus
  JSON-able extras (:class:`~astraflow.trainer.base.ShardedState`). On a ``CHECKPOINT`` every rank
  saves it with DCP in safetensors (``HuggingFaceStorageWriter``: no pickle, the sharding recorded in
  each file's header), uploads its own files and a rank manifest (their sha256) to
  ``<run>/trainer/<policy>/step-N/``; the leader writes the pointer naming every file and digest last,
  then commits the offsets it covers. A resume (any world size) verifies every file against the
  pointer (:class:`~astraflow.trainer.checkpoint.CheckpointError` if one differs) and lets DCP reshard
  into the new layout (:mod:`astraflow.trainer.sharded_checkpoint`).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

LEADER = 0
"""The rank that reads the log, publishes and writes the checkpoint pointer."""


class Command(IntEnum):
    """What the leader tells every rank to do this loop turn."""

    IDLE = 0
    """No batch this turn (the poll timed out, or the record was skipped): a heartbeat."""
    TRAIN = 1
    """Train on the batch whose Arrow IPC record bytes follow."""
    CHECKPOINT = 2
    """Save a checkpoint now (a collective DCP save)."""
    STOP = 3
    """Leave the loop (the step target is reached, or the leader was asked to stop)."""


@dataclass(frozen=True)
class RankGroup:
    """This process's place in its trainer's rank group (one rank when not launched by torchrun)."""

    rank: int = 0
    """Global rank (``RANK``)."""
    world_size: int = 1
    """Ranks in the group (``WORLD_SIZE``)."""
    local_rank: int = 0
    """Rank on this machine (``LOCAL_RANK``): which CUDA device the rank is pinned to."""
    launched: bool = False
    """Started by torch.distributed.run (even with one rank): a process group is set up."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RankGroup:
        """The group torch.distributed.run described in the environment; one rank without it."""
        env = dict(os.environ if env is None else env)
        if "WORLD_SIZE" not in env or "RANK" not in env:
            return cls()
        return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                   local_rank=int(env.get("LOCAL_RANK", "0")), launched=True)

    @property
    def leader(self) -> bool:
        return self.rank == LEADER

    @property
    def distributed(self) -> bool:
        """A process group is (to be) set up: collectives apply."""
        return self.launched

    def device(self, configured: str) -> str:
        """The torch device of this rank: ``cuda`` becomes ``cuda:<LOCAL_RANK>`` (a device the recipe
        pinned explicitly, ``cuda:3``, is kept as given only with one rank)."""
        if not self.launched or not configured.startswith("cuda"):
            return configured
        return f"cuda:{self.local_rank}"

    def start(self, configured_device: str, *, timeout_s: float = 1800.0) -> None:
        """Join the process group (gloo on CPU, NCCL on CUDA) and pin this rank's device. A rank also
        asks the kernel to SIGKILL it when its agent dies: the agent runs each worker in a session of
        its own, out of reach of the supervisor's signal to the agent's process group."""
        if not self.launched:
            return
        import torch
        import torch.distributed as dist

        _die_with_parent()
        _tag_log_records(self.rank)
        device = torch.device(self.device(configured_device))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                    **({"device_id": device} if device.type == "cuda" else {}))
        log.info("trainer rank %d/%d joined the group (%s on %s)", self.rank, self.world_size,
                 dist.get_backend(), device)

    def close(self) -> None:
        if self.launched:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    # -- collectives the service uses ------------------------------------------------------------
    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """The leader's ``data`` on every rank (others pass None). Raw bytes in a uint8 tensor, no
        pickle. Collective."""
        if not self.launched:
            return data or b""
        import torch
        import torch.distributed as dist

        device = _comm_device()
        size = torch.tensor([len(data) if self.leader and data else 0], dtype=torch.int64, device=device)
        dist.broadcast(size, src=LEADER)
        n = int(size.item())
        if n == 0:
            return b""
        if self.leader:
            buf = torch.frombuffer(bytearray(data or b""), dtype=torch.uint8).to(device)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=LEADER)
        return bytes(buf.cpu().numpy().tobytes()) if not self.leader else bytes(data or b"")

    def broadcast_json(self, obj: Any = None) -> Any:
        """The leader's JSON-able ``obj`` on every rank (others pass nothing). Collective."""
        if not self.launched:
            return obj
        return json.loads(self.broadcast_bytes(json.dumps(obj).encode() if self.leader else None))

    def broadcast_command(self, command: Command | None, payload: bytes = b"") -> tuple[Command, bytes]:
        """The leader's command (and payload) on every rank; others pass None. Collective."""
        if not self.launched:
            assert command is not None
            return command, payload
        framed = bytes([int(command)]) + payload if self.leader and command is not None else None
        got = self.broadcast_bytes(framed)
        return Command(got[0]), got[1:]

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over the ranks (float64). Collective."""
        if not self.launched or self.world_size == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        dist.all_reduce(t)
        return [float(x) for x in t.cpu()]

    def barrier(self) -> None:
        if self.launched:
            import torch.distributed as dist

            dist.barrier()


SINGLE = RankGroup()
"""One process, no process group: the trainer as it runs without ``trainer.ranks``."""


def current_group() -> RankGroup:
    """The group of this process as torch.distributed.run described it (one rank otherwise)."""
    return RankGroup.from_env()


def _comm_device() -> torch.device:
    """Where collectives' tensors live: the current CUDA device under NCCL, the CPU under gloo."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tag_log_records(rank: int) -> None:
    """Every log line of this process names its rank: the group's workers share one log file."""
    make = logging.getLogRecordFactory()

    def tagged(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        record.name = f"{record.name}[rank {rank}]"
        return record

    logging.setLogRecordFactory(tagged)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL): this rank dies with the agent that started it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the agent's own shutdown is all there is
        return
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)
