"""Starting and stopping the vLLM server a node runs for its ``vllm-server`` engine.

The server is vLLM's OpenAI-compatible API server (``python -m vllm.entrypoints.openai.api_server``:
the ``vllm`` console script of the CPU build fails), on a free loopback port, in a session of its own
that dies with the node (``PR_SET_PDEATHSIG``), its output in a log file. It is started with what
the engine relies on:

* ``--tokens-only``: the token-in/token-out ``/inference/v1/generate`` route, no tokenizer;
* ``VLLM_SERVER_DEV_MODE=1``: the ``/pause``, ``/resume``, ``/update_weight_version`` and
  ``/collective_rpc`` routes (on loopback only, as vLLM warns they must not be exposed);
* ``--worker-extension-cls``: AstraFlow's weight fetch/load methods on the workers;
* ``--logprobs-mode processed_logprobs``: log-probs after temperature scaling, as the trainer
  recomputes them; ``--no-async-scheduling``: a step's outputs are that step's tokens, so the
  weight-version spans vLLM reports are exact.

``VLLM_ALLOW_INSECURE_SERIALIZATION`` is removed from the server's environment: nothing it receives
is pickled.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.embedded.ports import LOOPBACK, port_is_free
from astraflow.process.sessions import log_tail, spawn_logged, terminate_groups
from connectors.vllm.engine import float32_env

if TYPE_CHECKING:
    import subprocess

    from connectors.vllm.config import VLLMServerEngineConfig

log = logging.getLogger(__name__)

WORKER_EXTENSION = "connectors.vllm.worker_extension.AstraFlowWorker"
STOP_GRACE_S = 10.0
"""SIGTERM, then SIGKILL of the server's group after this long."""


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A loopback port free now, below the kernel's ephemeral range (outgoing connections do not take it)."""
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free loopback port in [{low}, {high})")


def server_argv(python: str, model_path: str | Path, config: VLLMServerEngineConfig, port: int) -> list[str]:
    """The command line of a server for ``config`` serving ``model_path`` on ``127.0.0.1:port``."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
            "--host", LOOPBACK, "--port", str(port), "--dtype", config.dtype, "--seed", str(config.seed),
            "--max-num-seqs", str(config.max_num_seqs), "--gpu-memory-utilization", str(config.gpu_memory_utilization),
            "--skip-tokenizer-init", "--tokens-only", "--logprobs-mode", "processed_logprobs",
            "--no-async-scheduling", "--worker-extension-cls", WORKER_EXTENSION,
            "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching"]
    if config.max_model_len is not None:
        argv += ["--max-model-len", str(config.max_model_len)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    return argv + list(config.server_args)


def server_env(config: VLLMServerEngineConfig) -> dict[str, str]:
    """The node's environment plus what the server needs (see the module docstring)."""
    env = dict(os.environ)
    for name in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(name, None)  # no pickle on the wire; the in-process engine's setting is not the server's
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_gib))
    env.update(float32_env(config))
    if config.cpu_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
    if config.cpu_reserved_cores is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(config.cpu_reserved_cores)
    if config.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = config.device.split(":", 1)[1]  # the server's one GPU
    # The worker extension imports this package: make it importable whatever the interpreter.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class VLLMServer:
    """A vLLM server this process started; :meth:`stop` ends it (and every process it forked)."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path

    @classmethod
    def start(cls, model_path: str | Path, config: VLLMServerEngineConfig) -> VLLMServer:
        """Start a server for ``model_path`` and wait until it answers ``/health`` (at most
        ``config.start_timeout_s``); raises with the tail of its log if it exits or does not answer."""
        port = free_port()
        log_path = Path(tempfile.mkdtemp(prefix="astraflow-vllm-server-")) / "server.log"
        argv = server_argv(config.python or sys.executable, model_path, config, port)
        proc = spawn_logged(argv, log_path, env=server_env(config), die_with_parent=True)
        server = cls(proc, f"http://{LOOPBACK}:{port}", log_path)
        log.info("vllm server: starting %s (pid %d, log %s)", server.url, proc.pid, log_path)
        try:
            server._wait_healthy(config.start_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx2

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with status {self.proc.returncode} before it was "
                                   f"ready\n{log_tail(self.log_path, 40)}")
            try:
                if httpx2.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    log.info("vllm server: %s ready in %.1f s", self.url, time.monotonic() - t0)
                    return
            except httpx2.HTTPError:
                pass  # not listening yet
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the vLLM server did not answer {self.url}/health within {timeout_s:g} s\n"
                                   f"{log_tail(self.log_path, 40)}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe_exit(self) -> str:
        """A line for errors: whether the server still runs, and the tail of its log if not."""
        if self.alive():
            return f"the server (pid {self.proc.pid}) is running; its log: {self.log_path}"
        return f"the server exited with status {self.proc.returncode}\n{log_tail(self.log_path, 40)}"

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``STOP_GRACE_S``; reap the leader."""
        terminate_groups([self.proc.pid], lambda _pid: self.proc.poll() is None, STOP_GRACE_S,
                         kill_leaderless=True)
        self.proc.wait(timeout=STOP_GRACE_S)
