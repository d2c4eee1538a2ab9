"""Per-turn overhead of the multi-turn path against generation, on the demo's tiny checkpoint.

The multi-turn path adds, per turn: decode the turn and parse a tool call, run the tool, tokenise
the tool message once with the chat template's framing (``message_ids``), append the turn and the
observation to the transcript and rebuild the next context — plus the asyncio hops of an episode.
This measures that against what a turn costs anyway, one ``generate`` of the same number of
tokens with the built-in HF engine, side by side (interleaved repeats, one torch thread):

* ``bookkeeping_us``: the per-turn operations above, in a tight loop (no engine, no tool);
* ``episode_overhead_ms``: whole ``tool_agent`` episodes through the real HF engine, wall time
  minus the time spent inside ``generate``, per turn. The engine decodes exactly as many tokens
  as each scripted turn has (a tool call, then the answer) and returns the scripted ids, so every
  turn is a real forward pass over the real context while the episode deterministically calls the
  tool (an untrained tiny model would not);
* ``path_ms``: whole ``tool_agent`` episodes through an engine that answers the scripted turns
  instantly, per turn: everything the multi-turn path costs, with no model;
* ``generate_ms``: one ``generate`` of one turn's tokens from the same context length;
* ``one_shot_ms``: one ``generate`` of all the episode's model tokens from its prompt, against
  ``episode_ms`` (the multi-turn episode re-reads its context every turn: the HF engine keeps no
  prefix cache between calls).

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import torch

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.engines.hf import HFEngine
from astraflow.engines.weight_update import WeightUpdate
from astraflow.models import load_model, load_tokenizer, resolve_checkpoint
from astraflow.records import Task
from astraflow.tools.base import Tool, ToolConfig, register_tool
from astraflow.workflows import build_workflow
from astraflow.workflows.policy import SamplingConfig, policy_client
from astraflow.workflows.tool_calls import format_tool_call, parse_tool_call, wrap_response
from astraflow.workflows.transcript import Transcript

ROOT = Path(__file__).resolve().parent.parent
NO_STOP = (-1,)
"""A stop token no model emits: generate exactly ``max_new_tokens``."""


@register_tool("bench_product")
class ProductTool(Tool):
    """Multiplies two integers (the benchmark's stand-in for the calculator)."""

    description = 'multiplies two integers: {"a": int, "b": int}'

    class Config(ToolConfig):
        type: Literal["bench_product"] = "bench_product"

    async def call(self, arguments: dict[str, Any]) -> str:
        return str(int(arguments["a"]) * int(arguments["b"]))


class ForcedEngine(Engine):
    """The HF engine decoding exactly as many tokens as the scripted turn has, returning the
    scripted ids (real compute over the real context, deterministic content); times ``generate``."""

    def __init__(self, inner: HFEngine, turns: list[list[int]], eos: int) -> None:
        self.inner, self.turns, self.eos = inner, turns, eos
        self.accepted_updates = inner.accepted_updates
        self.seconds = 0.0
        self.calls = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for prompt in prompts:
            turn = self.turns[self.calls % len(self.turns)] + [self.eos]
            self.calls += 1
            t0 = time.perf_counter()
            [gen] = self.inner.generate([prompt], SamplingParams(len(turn), params.temperature, params.top_p, NO_STOP))
            self.seconds += time.perf_counter() - t0
            out.append(Generation(turn, gen.logprobs, gen.versions, "stop"))
        return out

    def update_weights(self, update: WeightUpdate) -> None:
        self.inner.update_weights(update)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()


class InstantEngine(ForcedEngine):
    """The scripted turns with no model at all: an episode through it costs only the multi-turn
    path (prompt rendering, hops to the engine thread, parsing, the tool, framing, appends)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for _ in prompts:
            turn = self.turns[self.calls % len(self.turns)] + [self.eos]
            self.calls += 1
            out.append(Generation(turn, [-0.5] * len(turn), [0] * len(turn), "stop"))
        return out


def bookkeeping_us(policy, prompt: list[int], turn: list[int], repeats: int) -> dict[str, float]:
    """Microseconds of one turn's multi-turn operations, each the median of ``repeats`` blocks of
    20: decode + parse the call, frame + tokenise the tool message, append both and build the next
    context; ``total`` is their sum."""
    eos = policy.tokenizer.eos_token_id
    gen = Generation([*turn, eos], [-0.5] * (len(turn) + 1), [0] * (len(turn) + 1), "stop")
    call = parse_tool_call(policy.decode(gen.token_ids), {"bench_product"})
    obs = policy.message_ids("tool", wrap_response("204383"))

    def append() -> None:
        tr = Transcript(list(prompt))
        for _ in range(3):  # a 3-turn episode's appends and contexts, per turn
            tr.add_generation(gen)
            tr.add_observation(obs)
            tr.context()

    parts = {
        "parse": lambda: parse_tool_call(policy.decode(gen.token_ids), {"bench_product"}),
        "message_ids": lambda: policy.message_ids("tool", wrap_response(str(int(call.arguments["a"]) * 589))),
        "transcript": append,
    }
    out = {}
    for name, fn in parts.items():
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            samples.append((time.perf_counter() - t0) / 20 * 1e6 / (3 if name == "transcript" else 1))
        out[name] = statistics.median(samples)
    out["total"] = sum(out.values())
    return out


async def thread_hop_ms(repeats: int) -> float:
    """Milliseconds of one empty ``asyncio.to_thread`` round trip: what every ``generate`` call
    pays to leave the event loop, single-turn or multi-turn (context for the episode overhead)."""
    samples = []
    for _ in range(repeats * 5):
        t0 = time.perf_counter()
        await asyncio.to_thread(lambda: None)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "examples/models/tiny.yaml"), help="checkpoint source")
    ap.add_argument("--calls", type=int, default=2, help="tool-calling turns before the answer turn")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved repeats of each measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 shared cores: 1 is steadier)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = resolve_checkpoint(args.model)
    tok, model = load_tokenizer(path), load_model(path)
    calls = [tok.encode(format_tool_call("bench_product", {"a": 347 + i, "b": 589}), add_special_tokens=False)
             for i in range(args.calls)]
    answer = tok.encode("The answer is 204383.", add_special_tokens=False)
    turns = [*calls, answer]
    engine = ForcedEngine(HFEngine(model), turns, tok.eos_token_id)
    policy = policy_client("agent", engine, tok, SamplingConfig(max_new_tokens=64), model.config.max_position_embeddings)
    wf = build_workflow({"type": "tool_agent", "tools": ["bench_product"], "max_turns": len(turns),
                         "system_prompt": "Use a tool.", "reward": "exact_match"})
    task = Task(prompt_id="b", prompt="Each box holds 347 coins. How many coins are in 589 boxes?",
                answer="204383", samples=1)

    async def episode():
        return await wf.run_episode(task, {"agent": policy})

    runner = asyncio.Runner()  # one event loop for every episode, as in a node (no loop setup timed)
    [traj] = runner.run(episode())  # warm-up; also the shapes the baselines use
    assert traj.rewards["tool_ok"] == args.calls and len(traj.turn_bounds) == 2 * len(turns), traj.turn_bounds
    model_tokens = sum(traj.loss_mask)
    per_turn = model_tokens / len(turns)
    mid_context = [*traj.prompt_ids, *traj.response_ids[: traj.turn_bounds[2]]]  # the 2nd turn's context
    plain = SamplingParams(round(per_turn), 1.0, 1.0, NO_STOP)
    whole = SamplingParams(model_tokens, 1.0, 1.0, NO_STOP)

    rows: dict[str, list[float]] = {"episode_ms": [], "episode_generate_ms": [], "generate_ms": [], "one_shot_ms": []}
    for _ in range(args.repeats):
        engine.seconds, engine.calls = 0.0, 0
        t0 = time.perf_counter()
        runner.run(episode())
        rows["episode_ms"].append((time.perf_counter() - t0) * 1e3)
        rows["episode_generate_ms"].append(engine.seconds * 1e3)
        t0 = time.perf_counter()
        engine.inner.generate([mid_context], plain)
        rows["generate_ms"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        engine.inner.generate([list(traj.prompt_ids)], whole)
        rows["one_shot_ms"].append((time.perf_counter() - t0) * 1e3)
    instant = policy_client("agent", InstantEngine(engine.inner, turns, tok.eos_token_id), tok,
                            SamplingConfig(max_new_tokens=64), model.config.max_position_embeddings)
    path_ms = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            runner.run(wf.run_episode(task, {"agent": instant}))
        path_ms.append((time.perf_counter() - t0) / 10 / len(turns) * 1e3)
    hop_ms = runner.run(thread_hop_ms(args.repeats))
    runner.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    overhead = statistics.median(e - g for e, g in zip(rows["episode_ms"], rows["episode_generate_ms"], strict=True))
    overhead_per_turn = overhead / len(turns)
    book = bookkeeping_us(policy, list(traj.prompt_ids), calls[0], args.repeats)
    result = {
        "benchmark": "multiturn",
        "model": Path(path).name,
        "threads": args.threads,
        "turns": len(turns),
        "tokens_per_turn": round(per_turn, 1),
        "observation_tokens": len(traj.response_ids) - model_tokens,
        "prompt_tokens": len(traj.prompt_ids),
        "bookkeeping_us_per_turn": round(book["total"], 1),
        "bookkeeping_us": {k: round(v, 1) for k, v in book.items() if k != "total"},
        "path_ms_per_turn": round(statistics.median(path_ms), 3),
        "episode_overhead_ms_per_turn": round(overhead_per_turn, 3),
        "thread_hop_ms": round(hop_ms, 3),
        "generate_ms_per_turn": round(med["generate_ms"], 2),
        "bookkeeping_ratio": round(book["total"] / 1e3 / med["generate_ms"], 4),
        "path_ratio": round(statistics.median(path_ms) / med["generate_ms"], 4),
        "overhead_ratio": round(overhead_per_turn / med["generate_ms"], 4),
        "episode_ms": round(med["episode_ms"], 1),
        "one_shot_generate_ms": round(med["one_shot_ms"], 1),
        "episode_vs_one_shot": round(med["episode_ms"] / med["one_shot_ms"], 3),
        "repeats": args.repeats,
    }
    print(f"per turn: bookkeeping {book['total']:.0f} us, whole path {statistics.median(path_ms):.2f} ms, "
          f"episode overhead {overhead_per_turn:.2f} ms, "
          f"generate of {per_turn:.0f} tokens {med['generate_ms']:.1f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
