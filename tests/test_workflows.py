"""Workflows return well-formed trajectories with the right rewards and group ids."""

import asyncio

import pytest

from astraflow.engines.base import Engine, Generation
from astraflow.models import NO, YES, build_model, build_tokenizer
from astraflow.records import Task
from astraflow.workflows import REWARDS, build_workflow, register_reward

TINY = "examples/models/tiny.yaml"


class ScriptedEngine(Engine):
    """Returns fixed token sequences (to check reward wiring exactly), version 5 on every token."""

    def __init__(self, responses: list[str]):
        self.tok = build_tokenizer()
        self.responses = responses
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts.extend(prompts)
        out = []
        for i, _ in enumerate(prompts):
            ids = [*self.tok.encode(self.responses[i % len(self.responses)], add_special_tokens=False),
                   self.tok.eos_token_id]
            out.append(Generation(ids, [-0.5] * len(ids), [5] * len(ids), "stop"))
        return out

    def load_weights(self, state_dict, version):
        raise NotImplementedError

    @property
    def weight_version(self):
        return 5

    def state_dict(self):
        return {}


def _task(samples=4):
    return Task(prompt_id="p1", prompt="max 3 7 1 =", answer="7", samples=samples, task_type="math")


def _check_fields(t, policy):
    n = len(t.response_ids)
    assert t.group_id == f"p1/{policy}" and t.task_id == "p1" and t.policy == policy
    assert t.episode_id == f"p1/{policy}/{t.sample_index}"
    assert len(t.logprobs) == len(t.versions) == len(t.loss_mask) == n > 0
    assert t.prompt_ids[0] == build_tokenizer().bos_token_id
    t.validate()


def test_math_workflow_rewards_correct_answers():
    eng = ScriptedEngine(["7", "3", "7", "1 2"])
    trajs = asyncio.run(build_workflow("math").run_episode(_task(), {"policy": eng}))
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0]
    assert [t.sample_index for t in trajs] == [0, 1, 2, 3]
    for t in trajs:
        _check_fields(t, "policy")
        assert t.versions == [5] * len(t.response_ids)


def test_math_workflow_with_real_engine():
    from astraflow.engines import build_engine

    eng = build_engine({}, build_model(TINY))
    trajs = asyncio.run(build_workflow("math", sampling={"max_new_tokens": 3}).run_episode(
        _task(6), {"policy": eng}))
    assert len(trajs) == 6 and all(t.reward in (0.0, 1.0) for t in trajs)
    for t in trajs:
        _check_fields(t, "policy")


def test_solver_verifier_gives_each_policy_its_own_rewards_and_groups():
    solver = ScriptedEngine(["7", "3", "7", "9"])
    verifier = ScriptedEngine([YES, YES, NO, NO])
    wf = build_workflow("solver_verifier")
    trajs = asyncio.run(wf.run_episode(_task(), {"solver": solver, "verifier": verifier}))
    s = [t for t in trajs if t.policy == "solver"]
    v = [t for t in trajs if t.policy == "verifier"]
    assert [t.reward for t in s] == [1.0, 0.0, 1.0, 0.0]
    # verdicts yes, yes, no, no on answers right, wrong, right, wrong
    assert [t.reward for t in v] == [1.0, 0.0, 0.0, 1.0]
    assert [t.rewards["solver_correct"] for t in v] == [1.0, 0.0, 1.0, 0.0]
    for t in s:
        _check_fields(t, "solver")
    for t in v:
        _check_fields(t, "verifier")
    tok = build_tokenizer()
    # the verifier saw the problem followed by the solver's answer
    assert tok.decode(verifier.prompts[1][1:]).split() == ["max", "3", "7", "1", "=", "3"]


def test_malformed_verdict_scores_zero():
    wf = build_workflow("solver_verifier")
    trajs = asyncio.run(wf.run_episode(_task(2), {"solver": ScriptedEngine(["7"]),
                                                  "verifier": ScriptedEngine(["4"])}))
    assert [t.reward for t in trajs if t.policy == "verifier"] == [0.0, 0.0]


def test_reward_plugins_are_registered_by_name():
    @register_reward("always_half")
    def half(response, task):
        return 0.5

    trajs = asyncio.run(build_workflow("math", reward="always_half").run_episode(
        _task(2), {"policy": ScriptedEngine(["1"])}))
    assert [t.reward for t in trajs] == [0.5, 0.5] and "always_half" in REWARDS
    with pytest.raises(ValueError):
        build_workflow("math", reward="nope")
    with pytest.raises(ValueError):
        build_workflow("nope")


def test_verifier_groups_per_answer():
    wf = build_workflow("solver_verifier", verifier_group="answer")
    trajs = asyncio.run(wf.run_episode(_task(3), {"solver": ScriptedEngine(["7", "3", "7"]),
                                                  "verifier": ScriptedEngine([YES])}))
    v = [t for t in trajs if t.policy == "verifier"]
    assert len(v) == 9 and len({t.episode_id for t in v}) == 9
    assert [t.group_id for t in v] == [f"p1/verifier/{i // 3}" for i in range(9)]
    assert [t.reward for t in v] == [1.0] * 3 + [0.0] * 3 + [1.0] * 3
    with pytest.raises(ValueError):
        build_workflow("solver_verifier", verifier_group="nope")
