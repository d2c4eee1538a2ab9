"""Workflows return well-formed trajectories with the right rewards and group ids, through each
policy's own tokenizer (the demo's tiny checkpoint: BPE + chat template)."""

import asyncio
from typing import Literal

import pytest
from fakes import FakeEngine, generation

from astraflow.engines.base import Generation
from astraflow.records import Task
from astraflow.workflows import REWARDS, Reward, SamplingConfig, build_workflow, register_reward
from astraflow.workflows.policy import policy_client
from astraflow.workflows.rewards import RewardConfig


def scripted_engine(tokenizer, responses: list[str]) -> FakeEngine:
    """A model returning fixed texts (to check reward wiring exactly), the k-th prompt's
    ``responses[k % len(responses)]`` plus eos, version 5."""
    def reply(_prompt: list[int], k: int) -> Generation:
        ids = tokenizer.encode(responses[k % len(responses)], add_special_tokens=False)
        return generation([*ids, tokenizer.eos_token_id], 5)
    return FakeEngine(reply, version=5)


@pytest.fixture
def scripted(tiny_tokenizer):
    def make(name: str, responses: list[str]):
        return policy_client(name, scripted_engine(tiny_tokenizer, responses), tiny_tokenizer)
    return make


def _task(samples=4):
    return Task(prompt_id="p1", prompt="max 3 7 1 =", answer="7", samples=samples, task_type="math")


def _check_fields(t, policy, tokenizer):
    n = len(t.response_ids)
    assert t.group_id == f"p1/{policy}" and t.task_id == "p1" and t.policy == policy
    assert t.episode_id == f"p1/{policy}/{t.sample_index}"
    assert len(t.logprobs) == len(t.versions) == len(t.loss_mask) == n > 0
    assert t.turn_bounds == [0, n]
    # the prompt went through the policy's chat template, and the response ends its turn
    assert "<|im_start|>assistant" in tokenizer.decode(t.prompt_ids)
    assert t.response_ids[-1] == tokenizer.eos_token_id
    t.validate()


def test_math_workflow_rewards_correct_answers(scripted, tiny_tokenizer):
    policy = scripted("policy", ["7", "3", "7", "1 2"])
    trajs = asyncio.run(build_workflow("math").run_episode(_task(), {"policy": policy}))
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0]
    assert [t.sample_index for t in trajs] == [0, 1, 2, 3]
    for t in trajs:
        _check_fields(t, "policy", tiny_tokenizer)
        assert t.versions == [5] * len(t.response_ids)


def test_math_workflow_with_real_engine(tiny_model, tiny_tokenizer):
    from astraflow.engines import build_engine

    policy = policy_client("policy", build_engine({"type": "hf"}, tiny_model), tiny_tokenizer,
                           SamplingConfig(max_new_tokens=3))
    trajs = asyncio.run(build_workflow("math").run_episode(_task(6), {"policy": policy}))
    assert len(trajs) == 6 and all(t.reward in (0.0, 1.0) for t in trajs)
    for t in trajs:
        assert 0 < len(t.response_ids) <= 3 and t.loss_mask == [1] * len(t.response_ids)
        assert all(lp <= 0 for lp in t.logprobs)


def test_solver_verifier_gives_each_policy_its_own_rewards_and_groups(scripted, tiny_tokenizer):
    solver = scripted("solver", ["7", "3", "7", "9"])
    verifier = scripted("verifier", ["<yes>", "<yes>", "<no>", "<no>"])
    wf = build_workflow({"type": "solver_verifier"})
    trajs = asyncio.run(wf.run_episode(_task(), {"solver": solver, "verifier": verifier}))
    s = [t for t in trajs if t.policy == "solver"]
    v = [t for t in trajs if t.policy == "verifier"]
    assert [t.reward for t in s] == [1.0, 0.0, 1.0, 0.0]
    # verdicts yes, yes, no, no on answers right, wrong, right, wrong
    assert [t.reward for t in v] == [1.0, 0.0, 0.0, 1.0]
    assert [t.rewards["solver_correct"] for t in v] == [1.0, 0.0, 1.0, 0.0]
    for t in s:
        _check_fields(t, "solver", tiny_tokenizer)
    for t in v:
        _check_fields(t, "verifier", tiny_tokenizer)
    # the verifier saw the problem followed by the solver's answer, in its chat template
    assert "max 3 7 1 = 3<|im_end|>" in tiny_tokenizer.decode(verifier.engine.prompts[1])


def test_malformed_verdict_scores_zero(scripted):
    wf = build_workflow({"type": "solver_verifier"})
    trajs = asyncio.run(wf.run_episode(_task(2), {"solver": scripted("solver", ["7"]),
                                                  "verifier": scripted("verifier", ["4"])}))
    assert [t.reward for t in trajs if t.policy == "verifier"] == [0.0, 0.0]


@register_reward("always_half")
class AlwaysHalf(Reward):
    class Config(RewardConfig):
        type: Literal["always_half"] = "always_half"

    def __call__(self, response, task):
        return 0.5


def test_reward_plugins_are_registered_by_name(scripted):
    wf = build_workflow({"type": "math", "reward": "always_half"})
    trajs = asyncio.run(wf.run_episode(_task(2), {"policy": scripted("policy", ["1"])}))
    assert [t.reward for t in trajs] == [0.5, 0.5] and "always_half" in REWARDS
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_workflow({"type": "math", "reward": "nope"})
    with pytest.raises(ValueError, match="unknown workflow 'nope'"):
        build_workflow("nope")


def test_verifier_groups_per_answer(scripted):
    wf = build_workflow({"type": "solver_verifier", "verifier_group": "answer"})
    trajs = asyncio.run(wf.run_episode(_task(3), {"solver": scripted("solver", ["7", "3", "7"]),
                                                  "verifier": scripted("verifier", ["<yes>"])}))
    v = [t for t in trajs if t.policy == "verifier"]
    assert len(v) == 9 and len({t.episode_id for t in v}) == 9
    assert [t.group_id for t in v] == [f"p1/verifier/{i // 3}" for i in range(9)]
    assert [t.reward for t in v] == [1.0] * 3 + [0.0] * 3 + [1.0] * 3
    with pytest.raises(ValueError, match="verifier_group"):
        build_workflow({"type": "solver_verifier", "verifier_group": "nope"})
    with pytest.raises(ValueError, match="verifier_from_solver applies to verifier_group 'balanced'"):
        build_workflow({"type": "solver_verifier", "verifier_group": "prompt", "verifier_from_solver": 2})


def test_workflows_declare_the_policies_they_call():
    assert build_workflow({"type": "math", "policy": "p"}).config.policies() == ["p"]
    cfg = build_workflow({"type": "solver_verifier", "solver_policy": "a", "verifier_policy": "b"}).config
    assert cfg.policies() == ["a", "b"] and cfg.roles() == {"a": "solver", "b": "verifier"}


def test_node_metrics_record_carries_the_workflow_counters():
    """Tool calls, timeouts, environment failures: what a workflow counts reaches the metrics topic."""
    from collections import Counter

    from astraflow.raas.metrics import NodeCounters

    counters = Counter(tool_calls=5, tool_timeout=2, env_failure=1)
    rec = NodeCounters("node-1", "default").record(4, {"agent": 3}, 0.1, 2, counters)
    assert rec.workflow == {"tool_calls": 5, "tool_timeout": 2, "env_failure": 1}
    assert rec.to_json()["component"] == "raas" and rec.id == "node-1"


def test_transcript_says_whether_the_episode_was_cut_at_its_token_cap():
    """``rewards["truncated"]``: 1.0 when the last model turn ended at its cap (finish_reason "length"),
    0.0 when it stopped; a workflow's own figure (an agent's turn limit) wins."""
    from astraflow.records.trajectory import TRUNCATED
    from astraflow.workflows.transcript import Transcript

    def episode(*reasons: Literal["stop", "length"], figures=None) -> float:
        tr = Transcript([1, 2])
        for reason in reasons:
            tr.add_generation(Generation([3, 4], [-0.1, -0.1], [0, 0], reason))
            tr.add_observation([5])
        return tr.to_trajectory(_task(), "policy", 0, 1.0, figures).rewards[TRUNCATED]

    assert episode("length") == 1.0 and episode("stop") == 0.0
    assert episode("length", "stop") == 0.0 and episode("stop", "length") == 1.0
    assert episode("stop", figures={TRUNCATED: 1.0}) == 1.0


@pytest.mark.parametrize("verdict", ["<yes>", "<no>"])
def test_verifier_evaluation_breaks_accuracy_down_by_candidate_kind(scripted, verdict):
    """Held-out verdicts are reported per kind of candidate (right, another number of the problem, a
    number it lacks), so a verifier that learns "yes if the number is in the problem" shows as such."""
    wf = build_workflow({"type": "solver_verifier", "verifier_chat": False})
    tasks = [Task(prompt_id=f"p{i}", prompt=f"max {i % 7} {i % 5 + 1} 9 =", answer="9", samples=1, task_type="math")
             for i in range(40)]
    got = asyncio.run(wf.evaluate("verifier", scripted("verifier", [verdict]), tasks))
    kinds = got["by_candidate"]
    assert got["n"] == 80 and sum(k["n"] for k in kinds.values()) == 80 and kinds["right"]["n"] == 40
    assert set(kinds) == {"right", "wrong_in_prompt", "wrong_other"}  # both kinds of wrong candidate occur
    says_yes = verdict == "<yes>"
    assert kinds["right"]["accuracy"] == float(says_yes) and got["accuracy"] == 0.5
    assert kinds["wrong_in_prompt"]["accuracy"] == kinds["wrong_other"]["accuracy"] == float(not says_yes)
