"""The ``http`` environment adapter against the real reference server (a subprocess on a free port):
a whole episode, cancel, and every failure it must turn into an EnvironmentFailure naming the URL."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeEngine, generation

from astraflow.engines.base import Generation
from astraflow.environments import ENVIRONMENTS, EnvironmentFailure, HttpEnvironment, build_environment
from astraflow.records import Task
from astraflow.workflows import build_workflow
from astraflow.workflows.policy import SamplingConfig, policy_client

SERVER = Path(__file__).resolve().parents[1] / "examples" / "environments" / "guess_number_server.py"


@pytest.fixture
def start_server() -> Iterator[Callable[..., str]]:
    """Starts ``guess_number_server.py --port 0 <args>`` and returns the URL it prints."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        proc = subprocess.Popen([sys.executable, str(SERVER), "--port", "0", *args],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        url = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert url.startswith("http://127.0.0.1:"), url
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def env_for(url: str, **options: Any) -> HttpEnvironment:
    return build_environment({"type": "http", "url": url, "backoff_s": 0.01, **options})


def task(sample_id: str = "7") -> Task:
    return Task(prompt_id="p-1", prompt="", samples=2, metadata={"sample_id": sample_id})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def play(env: HttpEnvironment, t: Task, index: int) -> tuple[list[str], float, int]:
    """Binary search to the secret: (observations, reward, guesses)."""
    started = await env.start(t, index)
    seen = [started.observation]
    low, high = 1, 100
    for guesses in range(1, 8):
        guess = (low + high) // 2
        step = await env.step(started.episode_id, f"My guess is {guess}.")
        seen.append(step.observation)
        if step.done:
            return seen, step.reward, guesses
        low, high = (guess + 1, high) if step.observation == "higher" else (low, guess - 1)
    raise AssertionError(f"not done after 7 guesses: {seen}")


def test_full_episodes_of_a_group_play_the_same_game(start_server: Callable[..., str]) -> None:
    env = env_for(start_server())

    async def group() -> list[tuple[list[str], float, int]]:
        try:
            return await asyncio.gather(play(env, task(), 0), play(env, task(), 1))
        finally:
            await env.close()

    (seen, reward, guesses), other = asyncio.run(group())
    assert seen[0].startswith("Guess my number between 1 and 100")
    assert seen[-1] == "correct" and reward == 1.0
    assert set(seen[1:-1]) <= {"higher", "lower"} and 1 <= guesses <= 7
    assert other == (seen, reward, guesses)  # same sample_id, same secret, same episode


def test_out_of_guesses_ends_with_zero_reward_and_cancel(start_server: Callable[..., str]) -> None:
    url = start_server("--max-guesses", "2")
    env = env_for(url)

    async def episode() -> None:
        started = await env.start(task(), 0)
        first = await env.step(started.episode_id, "no idea")
        assert (first.observation, first.reward, first.done) == (
            "Please answer with a number between 1 and 100.", 0.0, False)
        await env.cancel(started.episode_id)
        with pytest.raises(EnvironmentFailure, match=f"{url}/step: HTTP 404"):
            await env.step(started.episode_id, "50")
        await env.cancel(started.episode_id)  # cancelling twice is harmless
        again = await env.start(task(), 0)
        last = await env.step(again.episode_id, "0")
        last = await env.step(again.episode_id, "0")
        assert (last.reward, last.done) == (0.0, True)

    asyncio.run(episode())


def test_sample_id_template_and_integer_ids(start_server: Callable[..., str]) -> None:
    env = env_for(start_server(), sample_id="{prompt_id}-{sample_index}")
    assert env.sample_id(task(), 3) == "p-1-3"
    env = env_for("http://x:1", sample_id="{metadata[game]}", sample_id_type="int")
    assert env.sample_id(Task("p", "", metadata={"game": "42"}), 0) == 42
    with pytest.raises(EnvironmentFailure, match="no metadata 'game'"):
        env.sample_id(task(), 0)
    with pytest.raises(EnvironmentFailure, match="not an integer"):
        env.sample_id(Task("p", "", metadata={"game": "abc"}), 0)
    assert env_for("http://x:1").sample_id(Task("p-9", ""), 0) == "p-9"  # no metadata: the prompt id


def test_options_are_checked_at_load() -> None:
    with pytest.raises(ValueError, match="environment 'http': url: .*http:// or https://"):
        ENVIRONMENTS.parse({"type": "http", "url": "localhost:8000"})
    with pytest.raises(ValueError, match=r"sample_id: .*unknown field \{prompt\}"):
        ENVIRONMENTS.parse({"type": "http", "url": "http://h", "sample_id": "{prompt}"})
    with pytest.raises(ValueError, match="retries"):
        ENVIRONMENTS.parse({"type": "http", "url": "http://h", "retries": -1})
    with pytest.raises(ValueError, match="timout_s: Extra inputs"):  # a typo names the field
        ENVIRONMENTS.parse({"type": "http", "url": "http://h", "timout_s": 3})
    assert ENVIRONMENTS.parse({"type": "http", "url": "http://h:1/"}).url == "http://h:1"


def test_server_down_is_an_environment_failure() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = env_for(url, retries=2)
    with pytest.raises(EnvironmentFailure, match=f"{url}/start: cannot connect .*after 3 attempts"):
        asyncio.run(env.start(task(), 0))


def test_http_500_is_an_environment_failure_not_retried(start_server: Callable[..., str]) -> None:
    url = start_server("--fail-after", "2")
    env = env_for(url)
    with pytest.raises(EnvironmentFailure, match=f"{url}/start: HTTP 500: .*cannot load game 'fail-3'"):
        asyncio.run(env.start(task("fail-3"), 0))  # request 1

    async def breaks_mid_episode() -> None:
        started = await env.start(task(), 0)  # request 2
        with pytest.raises(EnvironmentFailure, match=f"{url}/step: HTTP 500: .*fail-after"):
            await env.step(started.episode_id, "50")  # request 3: a step is never retried

    asyncio.run(breaks_mid_episode())


def test_unavailable_server_is_retried_then_given_up(start_server: Callable[..., str]) -> None:
    url = start_server("--unavailable", "2")
    started = asyncio.run(env_for(url, retries=2).start(task(), 0))  # 503, 503, then the game
    assert started.observation.startswith("Guess my number")
    url = start_server("--unavailable", "5")
    with pytest.raises(EnvironmentFailure, match=f"{url}/start: HTTP 503: .*after 2 attempts"):
        asyncio.run(env_for(url, retries=1).start(task(), 0))


@pytest.fixture
def odd_server() -> Iterator[str]:
    """A server that answers every POST with the body named by its path (not the protocol)."""
    bodies = {"/notjson/start": b"<html>oops</html>", "/wrong/start": json.dumps({"id": 1}).encode(),
              "/wrong/step": json.dumps({"observation": "x", "reward": "lots", "done": False}).encode(),
              "/list/start": b"[1, 2]"}

    class Odd(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = bodies.get(self.path, b"{}")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_malformed_answers_are_environment_failures(odd_server: str) -> None:
    with pytest.raises(EnvironmentFailure, match=f"{odd_server}/notjson/start: answer is not JSON: <html>"):
        asyncio.run(env_for(f"{odd_server}/notjson").start(task(), 0))
    with pytest.raises(EnvironmentFailure, match=f"{odd_server}/wrong/start: malformed answer .*episode_id"):
        asyncio.run(env_for(f"{odd_server}/wrong").start(task(), 0))
    with pytest.raises(EnvironmentFailure, match=f"{odd_server}/wrong/step: malformed answer .*reward"):
        asyncio.run(env_for(f"{odd_server}/wrong").step("e", "a"))
    with pytest.raises(EnvironmentFailure, match=f"{odd_server}/list/start: malformed answer"):
        asyncio.run(env_for(f"{odd_server}/list").start(task(), 0))


# -- through the env_agent workflow ---------------------------------------------------------------
def binary_search_engine(tokenizer: Any) -> FakeEngine:
    """A stand-in model that plays the game well: reads its transcript (its guesses and the
    server's answers) and replies with the middle of what is left."""
    def reply(prompt: list[int], _k: int) -> Generation:
        text = tokenizer.decode(prompt)
        guesses = [int(g) for g in re.findall(r"assistant\n(\d+)<\|im_end\|>", text)]
        answers = re.findall(r"user\n(higher|lower)<\|im_end\|>", text)
        low, high = 1, 100
        for guess, answer in zip(guesses, answers, strict=True):
            low, high = (guess + 1, high) if answer == "higher" else (low, guess - 1)
        return generation([*tokenizer.encode(str((low + high) // 2), add_special_tokens=False),
                           tokenizer.eos_token_id], 3)
    return FakeEngine(reply, version=3)


@pytest.fixture(scope="module")
def agent() -> Any:
    pytest.importorskip("transformers")
    from astraflow.models.tiny import build_tokenizer

    tok = build_tokenizer(300)
    return policy_client("agent", binary_search_engine(tok), tok, SamplingConfig(max_new_tokens=8))


def test_env_agent_plays_the_real_server_and_a_failure_rejects_the_group(
        start_server: Callable[..., str], agent: Any) -> None:
    env = {"type": "http", "url": start_server(), "backoff_s": 0.01}
    wf = build_workflow({"type": "env_agent", "environment": env, "max_turns": 7})
    group = asyncio.run(wf.run_episode(Task("g-1", "", samples=3, metadata={"sample_id": "11"}), {"agent": agent}))
    assert group is not None and len(group) == 3
    for traj in group:
        traj.validate()
        assert traj.reward == 1.0 and traj.rewards["done"] == 1.0
        assert traj.rewards["env_steps"] == (len(traj.turn_bounds) + 1) // 2  # one action per model turn
        observations = [m for k, m in enumerate(traj.turn_bounds[1:-1]) if k % 2 == 0]
        assert all(traj.loss_mask[b] == 0 for b in observations)  # server text is never trained on
    assert [t.response_ids for t in group[1:]] == [group[0].response_ids] * 2  # one game per group
    assert wf.counters["done"] == 3 and wf.counters["env_failure"] == 0

    broken = {"type": "http", "url": start_server("--fail-after", "5"), "backoff_s": 0.01}
    wf = build_workflow({"type": "env_agent", "environment": broken, "max_turns": 7})
    out = asyncio.run(wf.run_episode(Task("g-2", "", samples=3, metadata={"sample_id": "11"}), {"agent": agent}))
    assert out is None  # 3 starts, 2 steps, then HTTP 500 mid-episode: no trajectory of the group
    assert wf.counters["env_failure"] == 1 and wf.counters["episodes"] == 0
