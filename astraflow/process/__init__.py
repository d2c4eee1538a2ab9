"""Child processes in sessions of their own: spawned with a log file, stopped group by group."""

from astraflow.process.sessions import child_processes, log_tail, signal_group, spawn_logged, terminate_groups

__all__ = ["child_processes", "log_tail", "signal_group", "spawn_logged", "terminate_groups"]
