"""The error every checkpoint reader raises for a checkpoint it cannot trust (its own module: the
single-process format, :mod:`astraflow.trainer.checkpoint`, and the sharded one,
:mod:`astraflow.trainer.sharded_checkpoint`, both raise it, and the first imports the second)."""


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be trusted (checksum mismatch, missing part, bad pointer)."""
