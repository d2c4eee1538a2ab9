"""A multi-turn, tool-using agent: the policy calls tools until it answers, the answer is rewarded.

One episode per sample, ``task.samples`` of them concurrently (so the engine batches their turns)::

    prompt = system (tools section) + task messages
    loop:   turn = generate(context)                      loss_mask 1, behaviour log-probs, versions
            call in turn?  -> run the tool (its timeout)  -> tool message ids   loss_mask 0
            no call        -> final answer                -> reward(answer text, task)

Token-in-token-out: the context of every turn is the transcript's ids exactly as the engine saw
and produced them; a tool result is tokenised once, framed by the chat template
(:meth:`PolicyClient.message_ids`), and appended. Limits: ``max_turns`` model turns, and
``max_total_tokens`` of prompt + response (default: the policy's context length); a turn cut by its
token limit ends the episode too. An episode stopped by a limit scores ``truncated_reward``.

Errors are observations: a malformed call (bad JSON, unknown tool), a tool error or a timeout is
shown to the model as the tool message and counted; the episode goes on.

Counters (``Workflow.counters``, published in the node's metrics): ``episodes``, ``answered``,
``truncated`` (with ``truncated_turns`` / ``truncated_tokens`` / ``truncated_length``),
``tool_calls`` (call attempts), ``valid_calls``, ``first_turn_call`` (episodes that open with a
well-formed call), ``malformed_call``, ``tool_ok``, ``tool_error``,
``tool_timeout`` (``tool_exception``: a tool raised something other than ``ToolError``; shown to
the model as an error). Each trajectory's ``rewards`` carries the episode's own figures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from astraflow.tools.base import Tool, ToolField, ToolResult, build_tool, run_tool
from astraflow.workflows.base import PolicyClient, SFTExample, Workflow, WorkflowConfig, register_workflow
from astraflow.workflows.policy import message_ids, render_messages
from astraflow.workflows.rewards import RewardField, build_reward
from astraflow.workflows.tool_calls import (
    RESPONSE_OPEN,
    MalformedCall,
    ToolCall,
    parse_tool_call,
    tools_section,
    wrap_response,
)
from astraflow.workflows.transcript import Transcript

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from astraflow.records import Task, Trajectory
    from astraflow.tasks import Problem

log = logging.getLogger(__name__)

DEMONSTRATION_KEY = "demonstration"
"""``Problem.metadata`` key of a warm-start demonstration: a JSON list of the assistant turns'
texts (tool calls, then the answer); the tool results are produced by running the real tools."""


@register_workflow("tool_agent")
class ToolAgentWorkflow(Workflow):
    class Config(WorkflowConfig):
        type: Literal["tool_agent"] = "tool_agent"
        policy: str = "agent"
        """The policy that acts (a task's own ``policy`` field wins when set)."""
        tools: list[ToolField] = Field(default_factory=list)
        """Tool plug-ins the agent may call, each with its options (``{type: calculator, timeout_s: 2}``)."""
        reward: RewardField = Field(default="exact_match", validate_default=True)
        """Reward plug-in applied to the final answer turn's text."""
        max_turns: int = Field(default=4, ge=1)
        """Most model turns per episode (tool-calling turns and the answer turn together)."""
        max_total_tokens: int | None = Field(default=None, ge=1)
        """Most prompt + response tokens per episode; ``None``: the policy's context length."""
        system_prompt: str = "Answer the question. Use a tool when it helps.\n\n{tools}"
        """System message; ``{tools}`` is replaced by the tools' descriptions and the call format."""
        tool_role: str = "tool"
        """Chat role of tool results (use "user" for a chat template without a tool role)."""
        wrap_responses: bool | None = None
        """Wrap results in ``<tool_response>`` tags; ``None``: only when the chat template does not
        already do it (Qwen2.5's does)."""
        truncated_reward: float = 0.0
        """Reward of an episode stopped by a limit before it answered."""

        def policies(self) -> list[str]:
            return [self.policy]

        def roles(self) -> dict[str, str]:
            return {self.policy: "agent"}

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.reward = build_reward(config.reward)
        self.tools: dict[str, Tool] = {}
        for entry in config.tools:
            tool = build_tool(entry)
            if tool.name in self.tools:
                raise ValueError(f"workflow tool_agent: tool {tool.name!r} is listed twice")
            self.tools[tool.name] = tool
        self.system = config.system_prompt.replace("{tools}", tools_section(list(self.tools.values()))).strip()
        self._wraps: dict[int, bool] = {}

    # -- one episode ------------------------------------------------------------------------------
    async def run_episode(self, task: Task, policies: Mapping[str, PolicyClient]) -> list[Trajectory] | None:
        name = task.policy or self.config.policy
        policy = self.policy(policies, name)
        prompt_ids = policy.prompt_ids(task, self.system)
        results = await asyncio.gather(*(self._sample(task, policy, prompt_ids) for _ in range(task.samples)))
        return [tr.to_trajectory(task, name, i, reward, figures)
                for i, (tr, reward, figures) in enumerate(results)]

    async def _sample(self, task: Task, policy: PolicyClient,
                      prompt_ids: list[int]) -> tuple[Transcript, float, dict[str, float]]:
        cfg = self.config
        tr = Transcript(list(prompt_ids))
        seen: Counter[str] = Counter(episodes=1)
        answer, stop = await self._turns(tr, policy, seen)
        if answer is not None:
            reward = self.reward(answer, task)
            seen["answered"] += 1
        else:
            reward = cfg.truncated_reward
            seen.update({"truncated": 1, f"truncated_{stop}": 1})
        self.counters.update(seen)
        figures = {self.reward.name: reward, "turns": float(tr.model_turns),
                   **{k: float(seen[k]) for k in ("tool_calls", "valid_calls", "malformed_call", "tool_ok",
                                                   "tool_error", "tool_timeout", "truncated")}}
        return tr, reward, figures

    async def _turns(self, tr: Transcript, policy: PolicyClient, seen: Counter[str]) -> tuple[str | None, str]:
        """Run the turns of one episode into ``tr``: the final answer's text, or ``None`` and the
        limit that stopped it ("turns", "tokens" or "length")."""
        cfg = self.config
        budget = cfg.max_total_tokens or policy.max_context
        per_turn = policy.sampling.max_new_tokens
        for turn in range(cfg.max_turns):
            room = budget - len(tr) if budget else per_turn
            if room < 1:
                return None, "tokens"
            t0 = time.perf_counter()
            [gen] = await policy.generate([tr.context()], min(per_turn, room))
            tr.add_generation(gen, time.perf_counter() - t0)
            if gen.finish_reason != "stop":
                return None, "length" if room >= per_turn else "tokens"
            text = policy.decode(gen.token_ids)
            try:
                call = parse_tool_call(text, self.tools)
            except MalformedCall as exc:
                seen.update(tool_calls=1, malformed_call=1)
                call, observation = None, f"error: {exc}"
            else:
                if call is None:
                    return text, ""
                seen.update(tool_calls=1, valid_calls=1, first_turn_call=int(turn == 0))
            if turn == cfg.max_turns - 1:  # no turn left to read a result: the call is not run
                break
            if call is not None:
                result = await self._run(call)
                seen[f"tool_{result.status}"] += 1
                observation = result.text
            obs_ids = policy.message_ids(cfg.tool_role, self._frame(policy.tokenizer, observation))
            if budget and len(tr) + len(obs_ids) >= budget:
                return None, "tokens"
            tr.add_observation(obs_ids)
        return None, "turns"

    async def _run(self, call: ToolCall) -> ToolResult:
        """The call under its tool's timeout; an unexpected exception of the tool is an error result
        (counted), not a crash of the whole group."""
        try:
            return await run_tool(self.tools[call.name], call.arguments)
        except Exception as exc:  # noqa: BLE001 - a tool bug must not kill the other episodes
            self.counters["tool_exception"] += 1
            log.warning("tool %s raised %s: %s (shown to the model as an error)", call.name, type(exc).__name__, exc)
            return ToolResult(f"error: {call.name} failed ({type(exc).__name__})", "error")

    def _frame(self, tokenizer: PreTrainedTokenizerBase, text: str) -> str:
        """``text`` as the content of the tool message (wrapped unless the template wraps it)."""
        wrap = self.config.wrap_responses
        if wrap is None:
            key = id(tokenizer)
            if key not in self._wraps:
                probe = message_ids(tokenizer, self.config.tool_role, "x", (tokenizer.eos_token_id,))
                self._wraps[key] = RESPONSE_OPEN not in tokenizer.decode(probe)
            wrap = self._wraps[key]
        return wrap_response(text) if wrap else text

    # -- evaluation and warm start ----------------------------------------------------------------
    async def evaluate(self, policy: str, client: PolicyClient, tasks: list[Task]) -> dict[str, Any]:
        """Greedy accuracy over whole episodes, plus ``valid_call_rate``: the share of episodes whose
        first turn is a well-formed call to a known tool (an agent that answers without calling,
        or calls malformed, counts against it)."""
        from astraflow.workflows.evaluate import episode_accuracy

        out = await episode_accuracy(self, policy, client, tasks)
        out["valid_call_rate"] = out.get("first_turn_call", 0) / len(tasks) if tasks else 0.0
        return out

    def warm_start_examples(self, policy: str, problems: list[Problem], tokenizer: PreTrainedTokenizerBase,
                            seed: int = 0) -> list[SFTExample]:
        """Whole tool-using transcripts (:func:`astraflow.workflows.tool_sft.tool_use_examples`: a
        problem's ``demonstration``, else a calculator call of its reference expression, else the
        bare answer), framed exactly as an episode frames them, trained on the assistant turns."""
        from astraflow.workflows import tool_sft

        return tool_sft.tool_use_examples(self, problems, tokenizer, seed)

    def demonstration(self, tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                      turns: list[str]) -> SFTExample:
        """An SFT example of an episode whose assistant turns are ``turns``: each turn's ids plus
        end of turn (loss mask 1), each call's real tool result as the episode would frame it
        (loss mask 0)."""
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("tool_agent demonstrations need a tokenizer with an eos token")
        prompt = render_messages(tokenizer, messages)
        ids, mask = list(prompt), [0] * len(prompt)
        for i, text in enumerate(turns):
            turn = [*tokenizer.encode(text, add_special_tokens=False), eos]
            ids += turn
            mask += [1] * len(turn)
            if i == len(turns) - 1:
                break
            try:
                call = parse_tool_call(text, self.tools)
            except MalformedCall as exc:  # a demonstration of the error observation
                observation = f"error: {exc}"
            else:
                if call is None:
                    raise ValueError(f"demonstration turn {i} makes no tool call, so an episode would end "
                                     "there; only the last turn may be the answer")
                observation = _run_sync(self._run(call)).text
            obs = message_ids(tokenizer, self.config.tool_role, self._frame(tokenizer, observation), (eos,))
            ids += obs
            mask += [0] * len(obs)
        return SFTExample(ids, mask)


def _run_sync(coro: Any) -> ToolResult:
    """Run a tool coroutine from synchronous code, even when the caller's thread has a loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
