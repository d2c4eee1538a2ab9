"""Multi-turn episodes are token-in-token-out: the trajectory's ids are exactly the ids the engine
was given, turn after turn, on a tokenizer where re-tokenising the decoded history gives other ids;
tool / environment tokens are masked with log-prob 0, ``turn_bounds`` are exact, per-token versions
are kept; limits, tool errors / timeouts and environment failures behave as documented; several
policies in one episode each get their own trajectory and masks."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
from fakes import FakeEngine

from astraflow.engines.base import Engine, Generation
from astraflow.environments.base import (
    ENVIRONMENTS,
    Environment,
    EnvironmentConfig,
    EnvironmentFailure,
    EnvStart,
    EnvStep,
    register_environment,
)
from astraflow.records import Task, Trajectory
from astraflow.tools.base import Tool, ToolConfig, ToolError, register_tool
from astraflow.workflows import build_workflow, register_workflow
from astraflow.workflows.base import PolicyClient, Workflow, WorkflowConfig
from astraflow.workflows.policy import SamplingConfig, message_ids, policy_client
from astraflow.workflows.tool_calls import MalformedCall, format_tool_call, parse_tool_call, wrap_response
from astraflow.workflows.transcript import Transcript

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# -- a tokenizer whose merges cross turn boundaries -----------------------------------------------
def train_bpe(chat_template: str | None = CHATML):
    """A byte-level BPE trained in code, with no regex pre-split, so merges run across newlines and
    turn framing: "bc" outranks "ab" ("ab"+"c" re-tokenises as "a"+"bc") and "\\n"+"c" is a merge
    (the generation prompt's "\\n" swallows the model's first "c" when re-tokenised)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    calls = [format_tool_call(f"test_{n}", {"a": 3, "b": 4}) for n in ("add", "fail", "sleep")]
    corpus = (["bc"] * 60 + ["ab"] * 40 + ["\nc"] * 30
              + [*calls, wrap_response("7"), "tool", "assistant", "user", "system"] * 4)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>")
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


def enc(tok, *pieces: str) -> list[int]:
    """Ids of ``pieces`` tokenised one by one (a model may emit any tokenisation of its text)."""
    return [i for p in pieces for i in tok.encode(p, add_special_tokens=False)]


# -- a scripted model -------------------------------------------------------------------------------
Reply = tuple[list[int], list[int]]
"""Token ids of one turn and the weight version of each token."""


def scripted_engine(script: Callable[[list[int], int], Reply], stop: int) -> FakeEngine:
    """A model answering ``script(prompt, call_index)``, batched like the HF engine (see FakeEngine)."""
    return FakeEngine(script, stop=stop, batch=True)


def turn_script(tok, turns: list[list[int]], versions: list[int] | None = None) -> Callable[[list[int], int], Reply]:
    """Reply with ``turns[k]`` (+ eos) on the k-th model turn of an episode (k counted from the
    generation prompts in the context), tagged ``versions[k]`` (default ``k``)."""
    opener = tok.encode("<|im_start|>assistant", add_special_tokens=False)

    def script(prompt: list[int], _call: int) -> Reply:
        k = sum(prompt[i:i + len(opener)] == opener for i in range(len(prompt))) - 1
        ids = [*turns[min(k, len(turns) - 1)], tok.eos_token_id]
        v = (versions or list(range(len(turns))))[min(k, len(turns) - 1)]
        return ids, [v] * len(ids)
    return script


def client(tok, engine: Engine, name: str = "agent", max_new_tokens: int = 200, max_context: int | None = None):
    return policy_client(name, engine, tok, SamplingConfig(max_new_tokens=max_new_tokens), max_context)


def task(samples: int = 1, answer: str = "7", prompt: str = "add 3 and 4") -> Task:
    return Task(prompt_id="p1", prompt=prompt, answer=answer, samples=samples, task_type="tool")


# -- tools and an environment registered for these tests --------------------------------------------
@register_tool("test_add")
class AddTool(Tool):
    description = 'adds two integers: {"a": int, "b": int}'

    class Config(ToolConfig):
        type: Literal["test_add"] = "test_add"

    async def call(self, arguments: dict[str, Any]) -> str:
        try:
            return str(int(arguments["a"]) + int(arguments["b"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ToolError(f"bad arguments ({exc})") from None


@register_tool("test_fail")
class FailTool(Tool):
    description = "always fails"

    class Config(ToolConfig):
        type: Literal["test_fail"] = "test_fail"

    async def call(self, arguments: dict[str, Any]) -> str:
        raise ToolError("the service said no")


@register_tool("test_sleep")
class SleepTool(Tool):
    description = "sleeps for a second"

    class Config(ToolConfig):
        type: Literal["test_sleep"] = "test_sleep"

    async def call(self, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(1.0)
        return "awake"


class CountdownLog:
    """What the test environment saw (class-level: one environment object per workflow)."""

    started: ClassVar[list[str]] = []
    cancelled: ClassVar[list[str]] = []
    actions: ClassVar[list[tuple[str, str]]] = []


@register_environment("test_countdown")
class CountdownEnv(Environment):
    """Done after ``steps`` actions, reward 1 per action that contains "go"; sample ``fail_sample``
    fails (EnvironmentFailure) on its ``fail_at``-th step."""

    class Config(EnvironmentConfig):
        type: Literal["test_countdown"] = "test_countdown"
        steps: int = 3
        fail_sample: int = -1
        fail_at: int = 1
        step_delay_s: float = 0.0

    async def start(self, task: Task, sample_index: int) -> EnvStart:
        eid = f"{task.prompt_id}#{sample_index}"
        CountdownLog.started.append(eid)
        return EnvStart(eid, f"count {self.config.steps}")

    async def step(self, episode_id: str, action: str) -> EnvStep:
        await asyncio.sleep(self.config.step_delay_s)
        CountdownLog.actions.append((episode_id, action))
        n = sum(e == episode_id for e, _ in CountdownLog.actions)
        if episode_id.endswith(f"#{self.config.fail_sample}") and n == self.config.fail_at:
            raise EnvironmentFailure("task server went away")
        return EnvStep(f"left {self.config.steps - n}", float("go" in action), n >= self.config.steps)

    async def cancel(self, episode_id: str) -> None:
        CountdownLog.cancelled.append(episode_id)


@pytest.fixture
def env_log():
    CountdownLog.started, CountdownLog.cancelled, CountdownLog.actions = [], [], []
    return CountdownLog


# -- checks shared by the tests ---------------------------------------------------------------------
def check_exact_prefix(engine: FakeEngine, traj: Trajectory) -> None:
    """Every prompt the engine got is the trajectory's prompt + response up to a model segment's
    start, in order; the model segments are exactly what the engine returned."""
    full = [*traj.prompt_ids, *traj.response_ids]
    starts = traj.turn_bounds[0:-1:2]
    assert len(engine.prompts) == len(starts)
    for prompt, start in zip(engine.prompts, starts, strict=True):
        assert prompt == full[: len(traj.prompt_ids) + start]


def segments(traj: Trajectory) -> list[tuple[int, int]]:
    return list(itertools.pairwise(traj.turn_bounds))


def check_masks(traj: Trajectory) -> None:
    """Model segments (even) are mask 1; observation segments (odd) mask 0 with log-prob 0 and the
    version of the last token before them."""
    traj.validate()
    assert traj.turn_bounds[0] == 0 and traj.turn_bounds[-1] == len(traj.response_ids)
    for k, (a, b) in enumerate(segments(traj)):
        assert b > a
        if k % 2 == 0:
            assert traj.loss_mask[a:b] == [1] * (b - a)
            assert all(lp < 0 for lp in traj.logprobs[a:b])
        else:
            assert traj.loss_mask[a:b] == [0] * (b - a)
            assert traj.logprobs[a:b] == [0.0] * (b - a)
            assert traj.versions[a:b] == [traj.versions[a - 1]] * (b - a)


# -- the exact-prefix invariant ---------------------------------------------------------------------
def test_bpe_retokenisation_differs_across_boundaries(bpe):
    """The premise: on this tokenizer, decode + encode does not give back what a model emitted."""
    assert enc(bpe, "abc") == enc(bpe, "a", "bc") != enc(bpe, "ab", "c")
    assert len(enc(bpe, "\nc")) == 1 and enc(bpe, "\n", "c") != enc(bpe, "\nc")


def test_tool_agent_keeps_the_engines_ids_turn_after_turn(bpe):
    """Turn 1 emits "c"+"ab"+"c" after the generation prompt's "\\n" (both "\\nc" and "bc" re-merge)
    and calls a tool; turn 2 answers. The second context re-tokenises differently from what the
    engine was given, yet the trajectory holds exactly the given ids; the tool result is tokenised
    once with the template's framing; versions swap between turns and inside the second turn."""
    call = format_tool_call("test_add", {"a": 3, "b": 4})
    turn1 = enc(bpe, "c", "ab", "c", call)
    turn2 = enc(bpe, "ab", "c", " 7")

    def script(prompt, k):
        if k == 0:
            return [*turn1, bpe.eos_token_id], [3] * (len(turn1) + 1)
        return [*turn2, bpe.eos_token_id], [4, 4] + [5] * (len(turn2) - 1)

    engine = scripted_engine(script, bpe.eos_token_id)
    wf = build_workflow({"type": "tool_agent", "tools": ["test_add"], "reward": "numeric_match",
                         "system_prompt": "calc"})
    [traj] = asyncio.run(wf.run_episode(task(answer="abc7"), {"agent": client(bpe, engine)}))

    check_exact_prefix(engine, traj)
    check_masks(traj)
    second = engine.prompts[1]
    assert bpe.encode(bpe.decode(second), add_special_tokens=False) != second  # re-tokenising would differ
    obs = message_ids(bpe, "tool", wrap_response("7"), (bpe.eos_token_id,))
    n1 = len(turn1) + 1
    assert traj.turn_bounds == [0, n1, n1 + len(obs), n1 + len(obs) + len(turn2) + 1]
    assert traj.response_ids == [*turn1, bpe.eos_token_id, *obs, *turn2, bpe.eos_token_id]
    assert bpe.decode(obs) == "\n<|im_start|>tool\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert traj.versions == [3] * n1 + [3] * len(obs) + [4, 4] + [5] * (len(turn2) - 1)
    assert traj.logprobs[:n1] == [-(k + 1) / 10 for k in range(n1)]
    assert traj.reward == 0.0  # "abc 7" is not the number 7: the answer turn's text was scored
    assert traj.rewards["tool_calls"] == traj.rewards["valid_calls"] == traj.rewards["tool_ok"] == 1.0
    assert traj.rewards["turns"] == 2.0 and traj.rewards["truncated"] == 0.0


def test_samples_run_concurrently_and_batch(bpe):
    """``task.samples`` episodes are in flight together: the engine sees their turns merged."""
    call = format_tool_call("test_add", {"a": 1, "b": 2})
    engine = scripted_engine(turn_script(bpe, [enc(bpe, call), enc(bpe, "3")]), bpe.eos_token_id)
    wf = build_workflow({"type": "tool_agent", "tools": ["test_add"], "reward": "numeric_match"})
    trajs = asyncio.run(wf.run_episode(task(samples=4, answer="3"), {"agent": client(bpe, engine)}))
    assert engine.batches == [4, 4]
    assert [t.reward for t in trajs] == [1.0] * 4 and [t.sample_index for t in trajs] == [0, 1, 2, 3]
    assert len({t.episode_id for t in trajs}) == 4 and {t.group_id for t in trajs} == {"p1/agent"}
    assert wf.counters["episodes"] == 4 and wf.counters["tool_ok"] == 4 and wf.counters["answered"] == 4


# -- errors are observations --------------------------------------------------------------------------
def test_tool_errors_timeouts_and_malformed_calls_are_shown_and_counted(bpe):
    turns = [enc(bpe, format_tool_call("test_fail", {})),
             enc(bpe, format_tool_call("test_sleep", {})),
             enc(bpe, '<tool_call>{"name": "test_add", "arguments": {"a": 1,</tool_call>'),
             enc(bpe, format_tool_call("nope", {"a": 1})),
             enc(bpe, format_tool_call("test_add", {"a": "x", "b": 1})),
             enc(bpe, "7")]
    engine = scripted_engine(turn_script(bpe, turns), bpe.eos_token_id)
    wf = build_workflow({"type": "tool_agent", "max_turns": 6, "reward": "numeric_match",
                         "tools": ["test_add", "test_fail", {"type": "test_sleep", "timeout_s": 0.05}]})
    [traj] = asyncio.run(wf.run_episode(task(), {"agent": client(bpe, engine)}))
    check_exact_prefix(engine, traj)
    check_masks(traj)
    seen = [bpe.decode(p) for p in engine.prompts]
    assert "error: the service said no" in seen[1]
    assert "error: test_sleep timed out after 0.05 s" in seen[2]
    assert "error: tool call is not valid JSON" in seen[3]
    assert "error: unknown tool 'nope'" in seen[4]
    assert "error: bad arguments" in seen[5]
    assert traj.reward == 1.0
    c = wf.counters
    assert (c["tool_calls"], c["valid_calls"], c["malformed_call"]) == (5, 3, 2)
    assert (c["tool_error"], c["tool_timeout"], c["tool_ok"]) == (2, 1, 0)
    assert traj.rewards["tool_timeout"] == 1.0 and traj.rewards["malformed_call"] == 2.0


def test_parse_tool_call():
    names = {"calculator"}
    assert parse_tool_call("the answer is 7", names) is None
    call = parse_tool_call('think <tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}'
                           '</tool_call> <tool_call>{"name": "x"}</tool_call>', names)
    assert (call.name, call.arguments) == ("calculator", {"expression": "3+4"})
    stringly = parse_tool_call('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}'
                               "</tool_call>", names)
    assert stringly.arguments == {"expression": "1"}
    for bad, why in [("<tool_call>{\"name\": \"calculator\"}", "not closed"),
                     ("<tool_call>[1]</tool_call>", "JSON object"),
                     ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "arguments must"),
                     ('<tool_call>{"name": "rm"}</tool_call>', "unknown tool 'rm'")]:
        with pytest.raises(MalformedCall, match=why):
            parse_tool_call(bad, names)


def test_unknown_tool_or_bad_option_is_refused_at_load():
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        build_workflow({"type": "tool_agent", "tools": ["nope"]})
    with pytest.raises(ValueError, match="timeout_s"):
        build_workflow({"type": "tool_agent", "tools": [{"type": "test_add", "timeout_s": "soon"}]})
    with pytest.raises(ValueError, match="max_turns"):
        build_workflow({"type": "tool_agent", "max_turns": 0})


# -- limits ---------------------------------------------------------------------------------------------
def test_max_turns_stops_without_running_the_last_call(bpe):
    call = enc(bpe, format_tool_call("test_add", {"a": 1, "b": 1}))
    engine = scripted_engine(turn_script(bpe, [call]), bpe.eos_token_id)
    wf = build_workflow({"type": "tool_agent", "tools": ["test_add"], "max_turns": 3, "truncated_reward": -1.0})
    [traj] = asyncio.run(wf.run_episode(task(), {"agent": client(bpe, engine)}))
    check_exact_prefix(engine, traj)
    check_masks(traj)
    assert len(traj.turn_bounds) == 6  # model, tool, model, tool, model: ends on the model's turn
    assert traj.reward == -1.0
    assert wf.counters["truncated"] == wf.counters["truncated_turns"] == 1
    assert wf.counters["tool_ok"] == 2 and wf.counters["tool_calls"] == 3


def test_max_total_tokens_bounds_the_episode(bpe):
    call = enc(bpe, format_tool_call("test_add", {"a": 1, "b": 1}))
    engine = scripted_engine(turn_script(bpe, [call]), bpe.eos_token_id)
    prompt_len = len(client(bpe, engine).prompt_ids(task(), "calc"))
    budget = prompt_len + 2 * (len(call) + 1) + 40  # two turns and part of a third fit
    wf = build_workflow({"type": "tool_agent", "tools": ["test_add"], "max_turns": 10, "system_prompt": "calc",
                         "max_total_tokens": budget})
    [traj] = asyncio.run(wf.run_episode(task(), {"agent": client(bpe, engine, max_new_tokens=100)}))
    check_exact_prefix(engine, traj)
    check_masks(traj)
    assert len(traj.prompt_ids) + len(traj.response_ids) <= budget
    for prompt, params in zip(engine.prompts, engine.params, strict=True):  # each turn asked for what fits
        assert params.max_new_tokens == min(100, budget - len(prompt))
    assert wf.counters["truncated_tokens"] == 1 and traj.reward == 0.0


def test_context_length_is_the_default_budget_and_a_cut_turn_ends_the_episode(bpe):
    engine = scripted_engine(turn_script(bpe, [enc(bpe, "a long answer that goes on")]), bpe.eos_token_id)
    wf = build_workflow({"type": "tool_agent", "system_prompt": "calc"})
    policy = client(bpe, engine, max_new_tokens=100, max_context=len(client(bpe, engine).prompt_ids(task(), "calc")) + 5)
    [traj] = asyncio.run(wf.run_episode(task(), {"agent": policy}))
    assert engine.params[0].max_new_tokens == 5 and len(traj.response_ids) == 5
    assert wf.counters["truncated_tokens"] == 1
    wf2 = build_workflow({"type": "tool_agent"})
    asyncio.run(wf2.run_episode(task(), {"agent": client(bpe, engine, max_new_tokens=3)}))
    assert wf2.counters["truncated_length"] == 1  # the per-turn limit cut the answer


# -- the environment agent ----------------------------------------------------------------------------
def test_env_agent_masks_observations_and_sums_rewards(bpe, env_log):
    actions = [enc(bpe, "go", " left"), enc(bpe, "wait"), enc(bpe, "go")]
    engine = scripted_engine(turn_script(bpe, actions, versions=[1, 2, 3]), bpe.eos_token_id)
    wf = build_workflow({"type": "env_agent", "environment": {"type": "test_countdown", "steps": 3},
                         "system_prompt": "act"})
    trajs = asyncio.run(wf.run_episode(task(samples=2), {"agent": client(bpe, engine)}))
    for traj in trajs:
        check_masks(traj)
        assert traj.reward == 2.0 and traj.rewards["done"] == 1.0 and traj.rewards["env_steps"] == 3.0
        assert len(traj.turn_bounds) == 6  # ends on the model's last action (no final observation)
        a, b = segments(traj)[1]
        assert bpe.decode(traj.response_ids[a:b]) == "\n<|im_start|>user\nleft 2<|im_end|>\n<|im_start|>assistant\n"
        assert traj.versions == [1] * segments(traj)[1][1] + [2] * (traj.turn_bounds[4] - traj.turn_bounds[2]) \
            + [3] * (traj.turn_bounds[5] - traj.turn_bounds[4])
    assert "count 3" in bpe.decode(trajs[0].prompt_ids) and "act" in bpe.decode(trajs[0].prompt_ids)
    assert [a for e, a in env_log.actions if e == "p1#0"] == ["go left", "wait", "go"]
    assert env_log.cancelled == [] and wf.counters["done"] == 2


def test_env_agent_limits_cancel_the_episode(bpe, env_log):
    engine = scripted_engine(turn_script(bpe, [enc(bpe, "go")]), bpe.eos_token_id)
    wf = build_workflow({"type": "env_agent", "environment": {"type": "test_countdown", "steps": 10},
                         "max_turns": 2})
    [traj] = asyncio.run(wf.run_episode(task(), {"agent": client(bpe, engine)}))
    check_exact_prefix(engine, traj)
    assert traj.reward == 2.0 and traj.rewards["truncated"] == 1.0  # earned so far
    assert env_log.cancelled == ["p1#0"] and wf.counters["truncated_turns"] == 1


def test_env_failure_rejects_the_whole_group(bpe, env_log):
    """Sample 2 fails on its second step while the others are mid-episode: no trajectory at all,
    every other started episode is cancelled on the environment, the failure is counted."""
    engine = scripted_engine(turn_script(bpe, [enc(bpe, "go")]), bpe.eos_token_id)
    wf = build_workflow({"type": "env_agent", "environment": {"type": "test_countdown", "steps": 5,
                                                              "fail_sample": 2, "fail_at": 2,
                                                              "step_delay_s": 0.01}})
    out = asyncio.run(wf.run_episode(task(samples=4), {"agent": client(bpe, engine)}))
    assert out is None
    assert wf.counters["env_failure"] == 1 and wf.counters["episodes"] == 0
    assert sorted(env_log.cancelled) == sorted(env_log.started) == [f"p1#{i}" for i in range(4)]


def test_a_cancelled_group_cancels_its_episodes(bpe, env_log):
    """The node stopping (the episode task cancelled) ends every running episode on the environment."""
    engine = scripted_engine(turn_script(bpe, [enc(bpe, "go")]), bpe.eos_token_id)
    wf = build_workflow({"type": "env_agent", "environment": {"type": "test_countdown", "steps": 5,
                                                              "step_delay_s": 0.5}})

    async def stop_early() -> list[str]:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(wf.run_episode(task(samples=3), {"agent": client(bpe, engine)}), 0.2)
        return list(env_log.cancelled)  # at once, in the same loop (not at asyncio.run's cleanup)

    assert sorted(asyncio.run(stop_early())) == sorted(env_log.started) == ["p1#0", "p1#1", "p1#2"]


# -- the real HTTP reference server --------------------------------------------------------------------
SERVER = Path(__file__).resolve().parents[1] / "examples" / "environments" / "guess_number_server.py"


@pytest.fixture
def guess_server() -> Iterator[str]:
    """``guess_number_server.py`` on a free port (a subprocess); yields its URL."""
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", "0", "--max-guesses", "20"],
                            stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert url.startswith("http://127.0.0.1:"), url
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def live_episodes(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
        return json.load(resp)["episodes"]


def _flaky_http():
    """An ``http`` environment whose sample ``fail_sample`` fails on its ``fail_step``-th step
    (the real server keeps serving the others): a failure in the middle of a live group."""
    from astraflow.environments.http import HttpEnvironment, HttpEnvironmentConfig

    if "test_flaky_http" in ENVIRONMENTS:
        return

    @register_environment("test_flaky_http")
    class FlakyHttp(HttpEnvironment):
        class Config(HttpEnvironmentConfig):
            type: Literal["test_flaky_http"] = "test_flaky_http"
            fail_sample: int = 1
            fail_step: int = 2

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.sample_of: dict[str, int] = {}
            self.steps: dict[str, int] = {}

        async def start(self, task: Task, sample_index: int) -> EnvStart:
            started = await super().start(task, sample_index)
            self.sample_of[started.episode_id] = sample_index
            return started

        async def step(self, episode_id: str, action: str) -> EnvStep:
            self.steps[episode_id] = self.steps.get(episode_id, 0) + 1
            if (self.sample_of[episode_id], self.steps[episode_id]) == (self.config.fail_sample, self.config.fail_step):
                raise EnvironmentFailure("injected: this sample's simulator crashed")
            return await super().step(episode_id, action)


def test_env_agent_on_the_real_http_server(bpe, guess_server):
    """Whole episodes against the reference server keep the exact prefix and mask its answers; a
    failure in one sample mid-group returns no trajectory and cancels every other episode on the
    server (none is left running)."""
    _flaky_http()
    engine = scripted_engine(turn_script(bpe, [enc(bpe, "I guess 0")]), bpe.eos_token_id)  # always "higher"
    wf = build_workflow({"type": "env_agent", "max_turns": 3,
                         "environment": {"type": "http", "url": guess_server, "backoff_s": 0.01}})
    group = asyncio.run(wf.run_episode(task(samples=3), {"agent": client(bpe, engine)}))
    for traj in group:
        check_masks(traj)
        assert traj.rewards["truncated"] == 1.0 and traj.reward == 0.0
        assert "Guess my number" in bpe.decode(traj.prompt_ids)
        a, b = segments(traj)[1]
        assert bpe.decode(traj.response_ids[a:b]) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert len(engine.prompts) == 9 and live_episodes(guess_server) == 0  # limits cancel on the server

    flaky = build_workflow({"type": "env_agent", "max_turns": 6,
                            "environment": {"type": "test_flaky_http", "url": guess_server, "backoff_s": 0.01}})
    assert asyncio.run(flaky.run_episode(task(samples=3), {"agent": client(bpe, engine)})) is None
    assert flaky.counters["env_failure"] == 1 and flaky.counters["episodes"] == 0
    env = flaky.environment
    assert len(env.sample_of) == 3 and max(env.steps.values()) < 6  # the others were mid-episode
    assert live_episodes(guess_server) == 0


# -- several policies in one episode ------------------------------------------------------------------
@register_workflow("test_debate")
class DebateWorkflow(Workflow):
    """Two policies take turns in one episode: each one's transcript holds its own turns (mask 1)
    and the other's words as user messages (mask 0)."""

    class Config(WorkflowConfig):
        type: Literal["test_debate"] = "test_debate"
        rounds: int = 2

        def policies(self) -> list[str]:
            return ["pro", "con"]

    async def run_episode(self, task: Task, policies: Mapping[str, PolicyClient]) -> list[Trajectory]:
        pro, con = policies["pro"], policies["con"]
        t_pro = Transcript(pro.prompt_ids(task))
        [g] = await pro.generate([t_pro.context()])
        t_pro.add_generation(g)
        t_con = Transcript(con.render([{"role": "user", "content": pro.decode(g.token_ids)}]))
        for r in range(self.config.rounds):
            [g] = await con.generate([t_con.context()])
            t_con.add_generation(g)
            if r == self.config.rounds - 1:
                break
            t_pro.add_observation(pro.message_ids("user", con.decode(g.token_ids)))
            [g] = await pro.generate([t_pro.context()])
            t_pro.add_generation(g)
            t_con.add_observation(con.message_ids("user", pro.decode(g.token_ids)))
        return [t_pro.to_trajectory(task, "pro", 0, 1.0), t_con.to_trajectory(task, "con", 0, 0.0)]


def test_two_policies_in_one_episode_get_their_own_trajectories(bpe):
    pro_engine = scripted_engine(lambda p, k: ([*enc(bpe, f"pro{k}"), bpe.eos_token_id], [10] * 5), bpe.eos_token_id)
    con_engine = scripted_engine(lambda p, k: ([*enc(bpe, f"con{k}"), bpe.eos_token_id], [70] * 5), bpe.eos_token_id)
    policies = {"pro": client(bpe, pro_engine, "pro"), "con": client(bpe, con_engine, "con")}
    pro, con = asyncio.run(build_workflow({"type": "test_debate", "rounds": 2}).run_episode(task(), policies))
    for traj, engine, version in [(pro, pro_engine, 10), (con, con_engine, 70)]:
        check_exact_prefix(engine, traj)
        check_masks(traj)
        assert traj.group_id == f"p1/{traj.policy}"
        trained = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
        assert bpe.decode(trained) == "".join(f"{traj.policy}{k}<|im_end|>" for k in range(2))
        assert {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m} == {version}
    a, b = segments(pro)[1]
    assert "con0" in bpe.decode(pro.response_ids[a:b])
    assert "pro0" in bpe.decode(con.prompt_ids) and "pro1" in bpe.decode(con.response_ids)


# -- message framing -------------------------------------------------------------------------------
QWEN3_LIKE = (  # renders a reasoning block only on assistant turns after the last user message
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_message_ids_frames_with_the_template_after_end_of_turn():
    tok = train_bpe(QWEN3_LIKE)
    ids = message_ids(tok, "user", "hi", (tok.eos_token_id,))
    # the "\n" the template writes after <|im_end|> (the model stopped at <|im_end|>) comes first,
    # even though this template renders the earlier assistant turn differently once a user follows
    assert tok.decode(ids) == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    plain = train_bpe(None)
    assert plain.decode(message_ids(plain, "user", "hi")) == "\nhi\n"


QWEN25_TOOLS = (  # Qwen2.5's handling of tool results: a user turn that wraps them in <tool_response>
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
    "\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_results_are_wrapped_once(bpe):
    """A template that wraps tool results itself gets the bare result; one that does not gets the
    <tool_response> tags from the workflow (``wrap_responses: null``, the default)."""
    qwen = train_bpe(QWEN25_TOOLS)
    for tok in (qwen, bpe):
        call = enc(tok, format_tool_call("test_add", {"a": 3, "b": 4}))
        engine = scripted_engine(turn_script(tok, [call, enc(tok, "7")]), tok.eos_token_id)
        wf = build_workflow({"type": "tool_agent", "tools": ["test_add"], "reward": "numeric_match"})
        [traj] = asyncio.run(wf.run_episode(task(), {"agent": client(tok, engine)}))
        a, b = segments(traj)[1]
        shown = tok.decode(traj.response_ids[a:b])
        assert shown.count("<tool_response>") == 1 and "<tool_response>\n7\n</tool_response>" in shown
        assert traj.reward == 1.0


def test_message_ids_refuses_templates_it_cannot_frame():
    drops_tools = train_bpe("{% for m in messages %}{% if m['role'] != 'tool' %}<|im_start|>{{ m['role'] }}\n"
                            "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="drops 'tool' messages"):
        message_ids(drops_tools, "tool", "result")
    no_eos = train_bpe("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ValueError, match="end-of-turn token"):
        message_ids(no_eos, "user", "hi")


def test_transcript_segments_alternate():
    tr = Transcript([1, 2])
    tr.add_generation(Generation([3, 4], [-0.1, -0.2], [0, 1], "length"))
    tr.add_generation(Generation([5], [-0.3], [1], "stop"))  # a continued turn stays one segment
    tr.add_observation([6, 7])
    tr.add_observation([8])
    tr.add_generation(Generation([9], [-0.4], [2], "stop"))
    assert tr.turn_bounds == [0, 3, 6, 7] and tr.loss_mask == [1, 1, 1, 0, 0, 0, 1]
    assert tr.versions == [0, 1, 1, 1, 1, 1, 2] and tr.context() == list(range(1, 10))


# -- warm start and evaluation ---------------------------------------------------------------------
def test_demonstrations_are_framed_exactly_as_episodes(bpe):
    """A warm-start transcript (real tool results) has the ids and masks of an episode whose model
    says the same: SFT and RL see the same framing."""
    from astraflow.tasks.base import Problem

    turns = [format_tool_call("test_add", {"a": 30, "b": 12}), "42"]
    problem = Problem(prompt_id="p1", prompt="add 30 and 12", answer="42",
                      metadata={"demonstration": json.dumps(turns)})
    wf = build_workflow({"type": "tool_agent", "tools": ["test_add"], "reward": "numeric_match"})
    [example] = wf.warm_start_examples("agent", [problem], bpe)
    engine = scripted_engine(turn_script(bpe, [enc(bpe, t) for t in turns]), bpe.eos_token_id)
    [traj] = asyncio.run(wf.run_episode(task(answer="42", prompt="add 30 and 12"), {"agent": client(bpe, engine)}))
    assert traj.reward == 1.0
    assert example.ids == [*traj.prompt_ids, *traj.response_ids]
    assert example.loss_mask == [0] * len(traj.prompt_ids) + traj.loss_mask


def test_evaluate_reports_the_valid_call_rate(bpe):
    turns = [enc(bpe, format_tool_call("test_add", {"a": 3, "b": 4})), enc(bpe, "<tool_call>oops</tool_call>"),
             enc(bpe, "7")]
    engine = scripted_engine(turn_script(bpe, turns), bpe.eos_token_id)
    wf = build_workflow({"type": "tool_agent", "tools": ["test_add"], "reward": "numeric_match"})
    out = asyncio.run(wf.evaluate("agent", client(bpe, engine), [task(samples=8), task(samples=8)]))
    assert out["accuracy"] == 1.0 and out["n"] == 2
    # every episode opened with a well-formed call (its second, malformed call does not change that)
    assert out["tool_calls"] == 4 and out["valid_calls"] == 2 and out["valid_call_rate"] == 1.0
    assert all(p.temperature == 0.0 for p in engine.params)
    malformed_first = scripted_engine(turn_script(bpe, [turns[1], turns[0], turns[2]]), bpe.eos_token_id)
    out = asyncio.run(wf.evaluate("agent", client(bpe, malformed_first), [task(samples=8), task(samples=8)]))
    assert out["valid_calls"] == 2 and out["valid_call_rate"] == 0.0


# -- the HF engine on a tiny real model -------------------------------------------------------------
def test_hf_engine_multi_turn_episode_on_a_tiny_model(bpe):
    """A tiny Qwen2 model taught one tool-using transcript (its demonstration) runs the episode with
    the built-in HF engine: call, tool result, answer — and the trajectory is that transcript."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from astraflow.engines.hf import HFEngine
    from astraflow.tasks.base import Problem

    wf = build_workflow({"type": "tool_agent", "tools": ["test_add"], "reward": "numeric_match",
                         "system_prompt": "calc"})
    turns = [format_tool_call("test_add", {"a": 3, "b": 4}), "7"]
    problem = Problem(prompt_id="p1", prompt="add 3 and 4", answer="7", metadata={"demonstration": json.dumps(turns)})
    [example] = wf.warm_start_examples("agent", [problem], bpe)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core box shared with other work: one thread is several times faster
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(bpe), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=True,
                                         pad_token_id=bpe.pad_token_id, eos_token_id=bpe.eos_token_id))
    ids = torch.tensor([example.ids])
    labels = torch.where(torch.tensor([example.loss_mask]) == 1, ids, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for _ in range(300):
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 1e-3:
                break
        engine = HFEngine(model.eval(), version=7)
        policy = policy_client("agent", engine, bpe, SamplingConfig(max_new_tokens=64, temperature=0.0), 256)
        [traj] = asyncio.run(wf.run_episode(task(), {"agent": policy}))
    finally:
        torch.set_num_threads(threads)
    assert [*traj.prompt_ids, *traj.response_ids] == example.ids
    assert [0] * len(traj.prompt_ids) + traj.loss_mask == example.loss_mask
    check_masks(traj)
    assert traj.reward == 1.0 and traj.rewards["tool_ok"] == 1.0 and set(traj.versions) == {7}
