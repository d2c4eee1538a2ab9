"""The ``http`` environment: an environment that runs as a service (AlfWorld, WebShop, a game, a
sandbox), driven over the start / step / cancel protocol of AstraFlow's task servers::

    POST {url}/start   {"sample_id": ...}                  -> {"episode_id": "...", "observation": "..."}
    POST {url}/step    {"episode_id": "...", "action": "..."} -> {"observation": "...", "reward": 0.0, "done": false}
    POST {url}/cancel  {"episode_id": "..."}               -> any 2xx (404: already gone, also fine)

Extra response fields are ignored; an ``episode_id`` may be a number. ``sample_id`` comes from the
task through a template (default: the task's ``metadata["sample_id"]``, else its ``prompt_id``), so
every sample of a GRPO group plays the same game.

Failures are :class:`~astraflow.environments.base.EnvironmentFailure` naming the URL, which rejects
the episode's whole group: connection refused, a timeout, a non-2xx answer, a body that is not the
protocol's JSON. Retries (with exponential backoff and jitter, so episodes that all lost a restarting
server do not return in lockstep) are only for requests the server cannot have acted on: a
connection that could not be made, and ``retry_statuses`` (by default 502/503/504: a proxy or a
server not ready). A plain 500 or a read timeout is not retried, because a ``step`` the server
already applied must not be applied twice.

Client: ``httpx2`` (the maintained httpx line, already required by ``huggingface_hub``): one
connection pool per event loop, so concurrent episodes share keep-alive connections.
"""

from __future__ import annotations

import asyncio
import random
import re
import string
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from astraflow.environments.base import (
    Environment,
    EnvironmentConfig,
    EnvironmentFailure,
    EnvStart,
    EnvStep,
    register_environment,
)

if TYPE_CHECKING:
    import httpx2

    from astraflow.records import Task

TEMPLATE_FIELDS = ("sample_id", "prompt_id", "sample_index", "task_type", "metadata")
"""Names a ``sample_id`` template may use (``metadata[key]`` for one metadata entry)."""


class HttpEnvironmentConfig(EnvironmentConfig):
    """Options of the HTTP environment adapter."""

    type: Literal["http"] = "http"
    url: str
    """Base URL of the environment server (``http://alfworld:8000``); the protocol's paths are
    appended to it."""
    sample_id: str = "{sample_id}"
    """Template of the ``sample_id`` sent to ``start``, with ``{sample_id}`` (the task's
    ``metadata["sample_id"]``, else its ``prompt_id``), ``{prompt_id}``, ``{sample_index}`` (0 ..
    group size - 1), ``{task_type}`` and ``{metadata[key]}``."""
    sample_id_type: Literal["str", "int"] = "str"
    """Send the sample id as a JSON string, or as a number (servers that index games by integer)."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """Longest wait to open a connection."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Longest wait for one answer (a ``step`` may run a simulator)."""
    retries: int = Field(default=3, ge=0)
    """Further attempts of a request that the server cannot have acted on (see the module doc)."""
    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubles with each further one (with jitter)."""
    max_backoff_s: float = Field(default=8.0, ge=0)
    """Longest wait between two attempts."""
    retry_statuses: list[int] = Field(default_factory=lambda: [502, 503, 504])
    """HTTP statuses that are retried; add 500 only for a server whose steps are idempotent."""
    max_connections: int = Field(default=64, ge=1)
    """Most simultaneous connections to the server from one node."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra request headers (an authorization token, ...)."""
    use_env_proxy: bool = False
    """Route through ``HTTP(S)_PROXY`` from the environment; off because environment servers
    usually sit on the cluster's own network."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
        return url.rstrip("/")

    @field_validator("sample_id")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        try:
            parts = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ValueError(f"not a format template: {exc}") from None
        for _, name, _, _ in parts:
            if name is None:
                continue
            root = re.match(r"[^.\[]*", name).group()  # type: ignore[union-attr]
            if root not in TEMPLATE_FIELDS or "." in name:
                raise ValueError(f"unknown field {{{name}}}; use {', '.join(TEMPLATE_FIELDS)}")
        return template


class _Started(BaseModel):
    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)
    episode_id: str
    observation: str


class _Stepped(BaseModel):
    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)
    observation: str
    reward: float
    done: bool


@register_environment("http")
class HttpEnvironment(Environment):
    """Episodes of a remote environment server (see the module docstring for the protocol)."""

    Config = HttpEnvironmentConfig
    config: HttpEnvironmentConfig

    def __init__(self, config: HttpEnvironmentConfig) -> None:
        super().__init__(config)
        self._client: httpx2.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, task: Task, sample_index: int) -> EnvStart:
        body = await self._post("start", {"sample_id": self.sample_id(task, sample_index)})
        started = self._parse(_Started, body, "start")
        return EnvStart(started.episode_id, started.observation)

    async def step(self, episode_id: str, action: str) -> EnvStep:
        body = await self._post("step", {"episode_id": episode_id, "action": action})
        stepped = self._parse(_Stepped, body, "step")
        return EnvStep(stepped.observation, stepped.reward, stepped.done)

    async def cancel(self, episode_id: str) -> None:
        await self._post("cancel", {"episode_id": episode_id}, gone_ok=True)

    async def close(self) -> None:
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._loop = None

    def sample_id(self, task: Task, sample_index: int) -> str | int:
        """The ``sample_id`` of ``task``'s sample ``sample_index``, from the configured template."""
        cfg = self.config
        fields = {"sample_id": task.metadata.get("sample_id", task.prompt_id), "prompt_id": task.prompt_id,
                  "sample_index": sample_index, "task_type": task.task_type, "metadata": task.metadata}
        try:
            text = cfg.sample_id.format_map(fields)
        except KeyError as exc:
            raise EnvironmentFailure(f"http environment {cfg.url}: task {task.prompt_id!r} has no "
                                     f"metadata {exc} for sample_id template {cfg.sample_id!r}") from None
        except (IndexError, ValueError, TypeError) as exc:
            raise EnvironmentFailure(f"http environment {cfg.url}: sample_id template {cfg.sample_id!r} "
                                     f"does not apply to task {task.prompt_id!r} ({exc})") from None
        if cfg.sample_id_type == "str":
            return text
        try:
            return int(text)
        except ValueError:
            raise EnvironmentFailure(f"http environment {cfg.url}: sample_id {text!r} of task "
                                     f"{task.prompt_id!r} is not an integer") from None

    # -- transport ---------------------------------------------------------------------------------
    def client(self) -> httpx2.AsyncClient:
        """The connection pool of the running event loop (a pool cannot be shared across loops)."""
        import httpx2  # ~0.3 s of imports (TLS): paid by nodes that run an HTTP environment only

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            cfg = self.config
            self._client = httpx2.AsyncClient(
                timeout=httpx2.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s),
                limits=httpx2.Limits(max_connections=cfg.max_connections,
                                     max_keepalive_connections=cfg.max_connections),
                headers=cfg.headers, trust_env=cfg.use_env_proxy)
            self._loop = loop
        return self._client

    async def _post(self, path: str, payload: dict[str, Any], *, gone_ok: bool = False) -> Any:
        """The decoded JSON answer to ``payload``, retrying what the server cannot have acted on."""
        import httpx2

        cfg = self.config
        url = f"{cfg.url}/{path}"
        problem = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            try:
                resp = await self.client().post(url, json=payload)
            except (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout) as exc:
                problem = f"cannot connect ({type(exc).__name__}: {exc})"
                continue
            except httpx2.TimeoutException:
                raise EnvironmentFailure(f"http environment {url}: no answer within {cfg.timeout_s:g} s") from None
            except httpx2.HTTPError as exc:
                raise EnvironmentFailure(f"http environment {url}: {type(exc).__name__}: {exc}") from None
            if resp.status_code in cfg.retry_statuses:
                problem = f"HTTP {resp.status_code}: {_excerpt(resp.text)}"
                continue
            if gone_ok and resp.status_code == 404:
                return None
            if not resp.is_success:
                raise EnvironmentFailure(f"http environment {url}: HTTP {resp.status_code}: {_excerpt(resp.text)}")
            try:
                return resp.json()
            except ValueError:
                raise EnvironmentFailure(f"http environment {url}: answer is not JSON: {_excerpt(resp.text)}") from None
        raise EnvironmentFailure(f"http environment {url}: {problem} (after {cfg.retries + 1} attempts)")

    def _backoff(self, attempt: int) -> float:
        """Seconds before attempt ``attempt`` (1, 2, ...): exponential, capped, jittered."""
        cfg = self.config
        return min(cfg.max_backoff_s, cfg.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def _parse(self, model: type[BaseModel], body: Any, path: str) -> Any:
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
            raise EnvironmentFailure(f"http environment {self.config.url}/{path}: malformed answer "
                                     f"({problems}): {_excerpt(str(body))}") from None


def _excerpt(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " ..."
