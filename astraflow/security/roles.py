"""Who may do what on a secured cluster's bucket: one S3 identity per role, its actions scoped to the
key prefixes of ARCHITECTURE.md's bucket layout (:class:`astraflow.objstore.layout.RunLayout`).

The S3 server enforces them (SeaweedFS identities, ``Action:bucket/prefix*``; on AWS the same rules as
IAM policies), not our client: a node's stolen key cannot put, overwrite or delete a weight, an
anchor, a manifest or a trainer checkpoint. ``*`` stands for any run, so one credential serves every
run of the cluster. The log (Kafka) cannot be scoped per topic by the embedded broker
(docs/security.md): what decides the model lives in the bucket, and the bucket is its guard.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["admin", "trainer", "node", "dataflow", "archiver", "reader"]
ROLES: tuple[Role, ...] = ("admin", "trainer", "node", "dataflow", "archiver", "reader")
"""``admin``: the operator and the embedded broker's own log storage; the others: one per component."""

WRITABLE_PREFIXES: dict[Role, tuple[str, ...]] = {
    "admin": (),
    # Its policy's versions (anchors, deltas, manifests; their GC deletes) and its checkpoints.
    "trainer": ("*/weights/*", "*/trainer/*", "*/claims/*"),
    # Large trajectories (claim check) and its weight-subscriber registration, nothing that decides a
    # version: a subscriber record only holds old versions back from GC.
    "node": ("*/claims/*", "*/weights/*/subscribers/*"),
    "dataflow": ("*/dataflow/*", "*/claims/*"),
    "archiver": ("*/archive/*", "*/dataflow/*"),
    "reader": (),
}
"""Key patterns under the data bucket that each role may put, overwrite and delete."""

POLICY_TRAINER = "trainer-"
"""A trainer's identity scoped to one policy is ``trainer-<policy>`` (:func:`policy_trainer`)."""


def policy_trainer(policy: str) -> str:
    """The identity of ``policy``'s trainer: it writes that policy's versions and checkpoints only, so a
    stolen trainer key of one policy cannot rewrite another's model."""
    return f"{POLICY_TRAINER}{policy}"


def writable_prefixes(identity: str) -> tuple[str, ...]:
    """Key patterns ``identity`` (a role, or a policy's trainer) may put, overwrite and delete."""
    if identity.startswith(POLICY_TRAINER):
        policy = identity.removeprefix(POLICY_TRAINER)
        return (f"*/weights/{policy}/*", f"*/trainer/{policy}/*", "*/claims/*")
    return WRITABLE_PREFIXES[identity]  # type: ignore[index]


LOG_WRITERS: tuple[Role, ...] = ("dataflow", "archiver")
"""Roles that trim the embedded broker's s3 log (:mod:`astraflow.log.trim` deletes its batch objects);
they may also write the broker's bucket."""


def s3_actions(role: str, bucket: str, log_bucket: str) -> list[str]:
    """The SeaweedFS identity actions of ``role`` (or of a policy's trainer) on the data ``bucket`` (and
    the embedded broker's ``log_bucket``): every role reads and lists, each writes only its prefixes,
    admin everything."""
    if role == "admin":
        return ["Admin", "Read", "List", "Tagging", "Write"]
    actions = [f"Read:{bucket}", f"List:{bucket}"]
    actions += [f"Write:{bucket}/{prefix}" for prefix in writable_prefixes(role)]
    if role in LOG_WRITERS:
        actions += [f"Read:{log_bucket}", f"List:{log_bucket}", f"Write:{log_bucket}"]
    return actions
