"""What a workflow sees of one policy: its engine, its tokenizer and its sampling settings.

The tokenizer travels with the policy (it is loaded from the policy's checkpoint), so workflows,
rewards and evaluation never reach for a global one. Everything here is token-in-token-out: a
prompt is rendered and tokenised once, generated ids are kept as the engine returned them, and a
message appended to a running conversation (a tool result, an environment observation) is
tokenised once on its own, framed by the chat template, and never merged with the history.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.workflows.seeding import next_call_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from astraflow.records import Task
    from astraflow.tasks.base import Problem

MESSAGES_KEY = "messages"
"""``Task.metadata`` key holding a chat prompt (JSON list of ``{role, content}``) from a dataset."""


class SamplingConfig(BaseModel):
    """Sampling settings of one policy."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=4, ge=1)
    """Longest response of one turn (the end-of-turn token counts)."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (must equal the trainer backend's temperature)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass."""
    regenerate_stale_after: int | None = Field(default=None, ge=0)
    """Async runs with long tails: once a group of continuations (one ``generate`` call) is complete,
    a continuation none of whose tokens is within this many versions of the weights now served is
    generated again, once, under those weights. The short siblings of a long sample are decoded
    first and wait for it; without this they arrive wholly stale and the dataflow drops them (and
    with them, often, the group). Set it below ``dataflow.max_staleness`` (the batches queued ahead
    of the trainer age a group further); pair it with ``dataflow.stale_tokens: mask``, which keeps the
    fresh tail of the long sample. None (default): never."""

    def params(self, stop_token_ids: tuple[int, ...] | None = None, max_new_tokens: int | None = None,
               seed: int | None = None) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens or self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, stop_token_ids=stop_token_ids, seed=seed)


def render_messages(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """A conversation as prompt ids, ending with the opening of the assistant's turn (the
    tokenizer's chat template), or ``bos + text`` of the messages for a tokenizer without one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "\n".join(m["content"] for m in messages)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [*bos, *tokenizer.encode(text, add_special_tokens=False)]


def with_system(messages: list[dict[str, str]], system: str | None) -> list[dict[str, str]]:
    """``messages`` with ``system`` prepended when given and the conversation has no system message."""
    if system and not any(m.get("role") == "system" for m in messages):
        return [{"role": "system", "content": system}, *messages]
    return messages


def task_messages(task: Task, system: str | None = None) -> list[dict[str, str]]:
    """The task's chat messages (a dataset's ``messages`` field), else its prompt as one user message."""
    raw = task.metadata.get(MESSAGES_KEY) if task.metadata else None
    messages = json.loads(raw) if raw else [{"role": "user", "content": task.prompt}]
    return with_system(messages, system)


def problem_messages(problem: Problem, system: str | None = None) -> list[dict[str, str]]:
    """A dataset problem's chat messages (its ``messages``, else its prompt as one user message)."""
    messages = ([{"role": r, "content": c} for r, c in problem.messages] if problem.messages
                else [{"role": "user", "content": problem.prompt}])
    return with_system(messages, system)


_PROBE = "ASTRAFLOW_PROBE_7f3a9c"
"""Assistant content used to locate where the template ends an assistant turn (never a real text)."""


def message_ids(tokenizer: PreTrainedTokenizerBase, role: str, content: str,
                stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Ids to append after the model's end-of-turn token so that a ``role`` message follows and
    the assistant's next turn opens — tokenised on its own, never merged with the history.

    With a chat template the framing is the template's own: ``[user, assistant, role message]`` is
    rendered with the generation prompt, and the ids are everything after the first end-of-turn
    token (``eos`` or one of ``stop_token_ids``) that closes the assistant turn, i.e. what the
    template writes after the token the model stopped at (ChatML's ``"\\n"`` after ``<|im_end|>``,
    the message, and the opening of the next assistant turn). Only the rendering of the *new*
    message is used, never a diff against a shorter render, so templates that render earlier turns
    differently once a later one follows (Qwen3 drops reasoning blocks) frame it correctly too.
    Without a template the message is its own text between newlines.

    Raises ValueError when the template cannot frame the message incrementally: it does not close an
    assistant turn with an end-of-turn token, or it drops ``role`` messages.
    """
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(f"\n{content}\n", add_special_tokens=False))
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE},
             {"role": role, "content": content}]
    text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    start = text.find(_PROBE)
    if start < 0:
        raise ValueError("the chat template does not render assistant messages; cannot frame a "
                         f"{role!r} message incrementally")
    start += len(_PROBE)
    ends = {t for t in (tokenizer.eos_token, *tokenizer.convert_ids_to_tokens(list(stop_token_ids))) if t}
    hits = [(text.find(e, start), e) for e in ends if text.find(e, start) >= 0]
    if not hits:
        raise ValueError(f"the chat template does not end an assistant turn with an end-of-turn token "
                         f"({sorted(ends)}); the model's turn and the {role!r} message cannot be joined")
    at, end = min(hits)
    suffix = text[at + len(end):]
    if content.strip() and content.strip() not in suffix:
        raise ValueError(f"the chat template drops {role!r} messages (the content is not rendered); "
                         "use a role it supports")
    return list(tokenizer.encode(suffix, add_special_tokens=False))


@dataclass
class PolicyClient:
    """One policy inside an episode: generate from token ids, render prompts with its tokenizer."""

    name: str
    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_context: int | None = None
    """Longest prompt + response the model serves (from the checkpoint's config)."""
    end_of_turn_ids: tuple[int, ...] = ()
    """Tokens besides the tokenizer's eos that end a turn (the checkpoint's generation config
    ``eos_token_id``: e.g. ``<|im_end|>`` for a base model whose eos is ``<|endoftext|>``)."""
    counters: Counter[str] = field(default_factory=Counter)
    """``regenerated``: continuations generated again (``SamplingConfig.regenerate_stale_after``);
    ``regenerated_tokens``: the tokens of the continuations they replaced (decoded, never sent)."""

    # -- tokens ------------------------------------------------------------------------------------
    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-turn tokens: the tokenizer's eos, then the checkpoint's other end-of-turn tokens."""
        eos = self.tokenizer.eos_token_id
        first = (eos,) if eos is not None else ()
        return first + tuple(t for t in self.end_of_turn_ids if t not in first)

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation as prompt ids (see :func:`render_messages`)."""
        return render_messages(self.tokenizer, messages)

    def task_messages(self, task: Task, system: str | None = None) -> list[dict[str, str]]:
        return task_messages(task, system)

    def prompt_ids(self, task: Task, system: str | None = None) -> list[int]:
        """The task's prompt ids: pre-tokenised ``task.prompt_ids`` when the dataflow set them,
        else the rendered chat (see :meth:`render`)."""
        if task.prompt_ids:
            return list(task.prompt_ids)
        return self.render(self.task_messages(task, system))

    def message_ids(self, role: str, content: str) -> list[int]:
        """Ids to append after the model's end-of-turn token so that a ``role`` message follows and
        the assistant's next turn opens (see :func:`message_ids`)."""
        return message_ids(self.tokenizer, role, content, self.stop_token_ids)

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids without end-of-turn / padding tokens."""
        drop = {*self.stop_token_ids, self.tokenizer.pad_token_id}
        return self.tokenizer.decode([t for t in ids if t not in drop], skip_special_tokens=False)

    # -- generation --------------------------------------------------------------------------------
    async def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None) -> list[Generation]:
        """Continuations of ``prompts`` with the policy's sampling, stopping at end of turn."""
        params = self.sampling.params(self.stop_token_ids or None, max_new_tokens, next_call_seed())
        gens = await self.engine.agenerate(prompts, params)
        lag = self.sampling.regenerate_stale_after
        if lag is None:
            return gens
        floor = self.engine.weight_version - lag
        stale = [i for i, g in enumerate(gens) if g.versions and max(g.versions) < floor]
        if not stale:
            return gens
        again = await self.engine.agenerate([prompts[i] for i in stale], replace(params, seed=next_call_seed()))
        for i, g in zip(stale, again, strict=True):
            self.counters["regenerated"] += 1
            self.counters["regenerated_tokens"] += len(gens[i].token_ids)
            gens[i] = g
        return gens


def policy_client(name: str, engine: Engine, tokenizer: Any, sampling: SamplingConfig | None = None,
                  max_context: int | None = None, end_of_turn_ids: tuple[int, ...] = ()) -> PolicyClient:
    """A :class:`PolicyClient` (the one constructor nodes, evaluation and tests use)."""
    return PolicyClient(name=name, engine=engine, tokenizer=tokenizer, sampling=sampling or SamplingConfig(),
                        max_context=max_context, end_of_turn_ids=tuple(end_of_turn_ids))
