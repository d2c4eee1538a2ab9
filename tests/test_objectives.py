"""The objective options (backend.objective) against independent plain-Python references, to 1e-5:
advantage estimators, reward shaping, aggregation, KL to the reference, entropy bonus, dual clip;
the recipe refuses a misspelt option; a KL term keeps the policy closer to its reference."""

import math
import random
from pathlib import Path

import pytest
import torch
import yaml

from astraflow.config import ConfigError
from astraflow.records import Trajectory
from astraflow.trainer.advantages import advantages, overlong_penalty
from astraflow.trainer.config import TorchBackendConfig
from astraflow.trainer.loss import token_entropy
from astraflow.trainer.objective import ObjectiveConfig, OverlongConfig
from astraflow.trainer.torch_backend import TorchBackend

# -- plain references, written from the papers' definitions with loops and floats only ------------------


def ref_advantages(kind, rewards, groups, tokens, eps=1e-6):
    out = []
    for i, g in enumerate(groups):
        rs = [rewards[j] for j in range(len(groups)) if groups[j] == g]
        mu = sum(rs) / len(rs)
        sd = (sum((r - mu) ** 2 for r in rs) / len(rs)) ** 0.5
        if kind == "grpo":
            out.append((rewards[i] - mu) / (sd + eps))
        elif kind == "dr_grpo":
            out.append(rewards[i] - mu)
        elif kind == "rloo":
            others = [rewards[j] for j in range(len(groups)) if groups[j] == g and j != i]
            out.append(rewards[i] - sum(others) / len(others) if others else 0.0)
        else:  # reinforce_pp: every loss token carries its trajectory's reward; normalise over all tokens
            flat = [rewards[j] for j in range(len(rewards)) for _ in range(int(tokens[j]))]
            m = sum(flat) / len(flat)
            s = (sum((x - m) ** 2 for x in flat) / len(flat)) ** 0.5
            out.append((rewards[i] - m) / (s + eps))
    return out


def ref_overlong(length, l_max, l_cache, penalty):
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return penalty * ((l_max - l_cache) - length) / l_cache
    return -penalty


def ref_entropy(logits_row):
    z = max(logits_row)
    ex = [math.exp(x - z) for x in logits_row]
    s = sum(ex)
    return -sum((e / s) * math.log(e / s) for e in ex)


def ref_loss(logp, prox, behav, ref, ent, adv, mask, *, aggregation, norm_tokens=None, clip=0.2, clip_hi=0.28,
             cap=2.0, dual=None, kl_coef=0.0, kl_est="k3", ent_coef=0.0):
    per_row = []
    for i in range(len(logp)):
        terms = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - prox[i][t])
            surr = min(ratio * adv[i], min(max(ratio, 1 - clip), 1 + clip_hi) * adv[i])
            if dual is not None and adv[i] < 0:
                surr = max(surr, dual * adv[i])
            term = -min(math.exp(prox[i][t] - behav[i][t]), cap) * surr
            if kl_coef:
                d = ref[i][t] - logp[i][t]
                term += kl_coef * (-d if kl_est == "k1" else math.exp(d) - d - 1)
            term -= ent_coef * ent[i][t]
            terms.append(term)
        per_row.append(terms)
    n = len(per_row)
    if aggregation == "token_mean":
        return sum(sum(r) for r in per_row) / sum(len(r) for r in per_row)
    if aggregation == "seq_mean":
        return sum(sum(r) / len(r) for r in per_row if r) / n
    return sum(sum(r) / norm_tokens for r in per_row) / n


# -- fixtures -----------------------------------------------------------------------------------------------


def _trajectories(model, tok, rewards, lengths):
    """Two groups of four: rewards and response lengths as given; behaviour log-probs from ``model``
    shifted a little (off-policy), so that the importance weight is not 1."""
    out = []
    for k, (reward, n) in enumerate(zip(rewards, lengths, strict=True)):
        g, i = divmod(k, 4)
        prompt = tok.encode(["max 3 7 1 =", "min 4 2 9 5 ="][g], add_special_tokens=False)
        resp = [5 + (3 * k + j) % 20 for j in range(n)]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([prompt + resp])).logits[0], -1)
        out.append(Trajectory(
            episode_id=f"p{g}/policy/{i}", task_id=f"p{g}", group_id=f"p{g}/policy", sample_index=i, policy="policy",
            prompt_ids=prompt, response_ids=resp,
            logprobs=[float(lp[len(prompt) - 1 + j, t]) - 0.05 * (j % 3) for j, t in enumerate(resp)],
            versions=[0] * n, loss_mask=[1] * n, reward=reward, rewards={}, turn_bounds=[0, n], node_id="n",
            created_at=0.0, gen_seconds=0.0, task_type="math"))
    return out


REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
LENGTHS = [1, 2, 3, 4, 2, 5, 1, 3]


# -- advantages and shaping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_advantage_estimators_match_their_definitions(kind):
    rng = random.Random(7)
    groups = [f"g{i // 5}" for i in range(15)] + ["lonely"]
    rewards = [rng.uniform(-1, 2) for _ in groups]
    tokens = [float(rng.randint(1, 9)) for _ in groups]
    got = advantages(ObjectiveConfig(advantage=kind), rewards, groups, tokens, eps=1e-6)
    assert got == pytest.approx(ref_advantages(kind, rewards, groups, tokens), abs=1e-5)


def test_overlong_penalty_is_dapos_soft_punishment():
    cfg = OverlongConfig(max_tokens=10, buffer=4, penalty=0.5)
    for n in range(14):
        assert overlong_penalty(n, cfg) == pytest.approx(ref_overlong(n, 10, 4, 0.5), abs=1e-9)
    assert overlong_penalty(6, cfg) == 0.0 and overlong_penalty(8, cfg) == -0.25 and overlong_penalty(11, cfg) == -0.5


def test_token_entropy_matches_the_softmax_definition():
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = token_entropy(torch.log_softmax(logits, -1))
    want = [[ref_entropy(logits[b, t].tolist()) for t in range(4)] for b in range(3)]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-5)


# -- the whole step's loss: skeleton (plan, row scales) + loss module against the reference --------------


OPTIONS = [
    {"advantage": "dr_grpo", "aggregation": "seq_mean_token_sum", "norm_tokens": 6},
    {"advantage": "rloo", "aggregation": "seq_mean"},
    {"advantage": "reinforce_pp", "dual_clip": 3.0},
    {"kl": {"coef": 0.3, "estimator": "k1"}, "entropy_coef": 0.01},
    {"kl": {"coef": 0.3, "estimator": "k3"}, "aggregation": "seq_mean", "dual_clip": 1.5},
    {"overlong": {"max_tokens": 4, "buffer": 2, "penalty": 1.0}, "entropy_coef": 0.05},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(sorted(o)))
def test_the_steps_loss_matches_the_reference(options, tiny_model, tiny_tokenizer):
    backend = TorchBackend(tiny_model, TorchBackendConfig(objective=options, clip_eps_high=0.28))
    obj = backend.config.objective
    trajs = _trajectories(backend.model, tiny_tokenizer, REWARDS, LENGTHS)
    if obj.kl is not None:  # a reference that is not the policy: perturbed weights
        state = {k: v + 0.02 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
                 for k, v in backend.state_dict().items()}
        backend.set_reference(state)
    plan = backend.plan(trajs)
    assert plan.trained[0] == list(range(8)) or obj.terms_vanish_with_advantage
    # the reference advantages, from the shaped rewards
    shaped = [r + (ref_overlong(n, 4, 2, 1.0) if obj.overlong else 0.0) for r, n in zip(REWARDS, LENGTHS, strict=True)]
    want_adv = ref_advantages(obj.advantage, shaped, [t.group_id for t in trajs], LENGTHS)
    assert plan.advantages == pytest.approx(want_adv, abs=1e-5)

    ids, attn, gpos, behav, mask = backend._tensors(trajs)
    logits = backend.logits(ids, attn).float()
    rows = logits.gather(1, gpos[:, :, None].expand(-1, -1, logits.shape[-1]))
    logp, entropy = backend._scores(ids, attn, gpos, entropy="grad")
    with torch.no_grad():
        ref_lp = backend._scores(ids, attn, gpos, model=backend.reference)[0] if obj.kl else logp
    prox = logp.detach() + 0.1 * torch.sin(torch.arange(logp.numel()).view_as(logp))  # ratios away from 1
    scales = plan.row_scales(0, list(range(8)))
    loss, metrics = backend.objective_loss(
        logp, prox, behav, torch.tensor(plan.advantages), mask, batch_tokens=plan.batch_tokens(0),
        row_scale=None if scales is None else torch.tensor(scales), ref_logp=ref_lp, entropy=entropy)

    as_lists = [x.detach().tolist() for x in (logp, prox, behav, ref_lp)]
    m = mask.tolist()
    ent = [[ref_entropy(rows[b, t].tolist()) for t in range(rows.shape[1])] for b in range(rows.shape[0])]
    want = ref_loss(*as_lists, ent, want_adv, m, aggregation=obj.aggregation, norm_tokens=obj.norm_tokens,
                    dual=obj.dual_clip, kl_coef=obj.kl.coef if obj.kl else 0.0,
                    kl_est=obj.kl.estimator if obj.kl else "k3", ent_coef=obj.entropy_coef)
    assert loss.item() == pytest.approx(want, abs=1e-5)
    flat_ent = [e for b, row in enumerate(ent) for t, e in enumerate(row) if m[b][t]]
    assert metrics["entropy"] == pytest.approx(sum(flat_ent) / len(flat_ent), abs=1e-5)
    if obj.kl is not None:
        d = [r - p for lr, lp in zip(as_lists[3], as_lists[0], strict=True) for r, p in zip(lr, lp, strict=True)]
        flat_m = [x for row in m for x in row]
        kl = [(-x if obj.kl.estimator == "k1" else math.exp(x) - x - 1) for x in d]
        assert metrics["kl_ref"] == pytest.approx(sum(k * w for k, w in zip(kl, flat_m, strict=True)) / sum(flat_m),
                                                  abs=1e-5)


def test_kl_folded_into_the_reward_shapes_the_advantages(tiny_model, tiny_tokenizer):
    backend = TorchBackend(tiny_model, TorchBackendConfig(objective={"advantage": "dr_grpo",
                                                                     "kl": {"coef": 0.5, "mode": "reward"}}))
    trajs = _trajectories(backend.model, tiny_tokenizer, REWARDS, LENGTHS)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2))
             for k, v in backend.state_dict().items()}
    backend.set_reference(state)
    ref_lp = backend._reference_logprobs(trajs).tolist()
    kl_sums = []
    for i, t in enumerate(trajs):  # k3 of the behaviour log-probs against the reference's, summed per trajectory
        kl_sums.append(sum(math.exp(ref_lp[i][j] - b) - (ref_lp[i][j] - b) - 1 for j, b in enumerate(t.logprobs)))
    shaped = [r - 0.5 * k for r, k in zip(REWARDS, kl_sums, strict=True)]
    plan = backend.plan(trajs)
    assert plan.advantages == pytest.approx(ref_advantages("dr_grpo", shaped, [t.group_id for t in trajs], LENGTHS),
                                            abs=1e-5)
    assert plan.metrics["kl_ref"] == pytest.approx(sum(kl_sums) / sum(LENGTHS), abs=1e-5)
    m = backend.step(trajs)
    assert m["kl_ref"] > 0 and "entropy" in m


def test_a_larger_kl_coefficient_keeps_the_policy_closer_to_its_reference(new_model_factory, tiny_tokenizer):
    kl_after = {}
    for coef in (1e-4, 3.0):
        backend = TorchBackend(new_model_factory(), TorchBackendConfig(lr=3e-3, objective={"kl": {"coef": coef}}))
        backend.set_reference(backend.state_dict())
        trajs = _trajectories(backend.model, tiny_tokenizer, REWARDS, LENGTHS)
        first = backend.step(trajs)
        assert first["kl_ref"] == 0.0  # the first step's loss sees the reference's own weights
        for _ in range(8):
            last = backend.step(trajs)
        kl_after[coef] = last["kl_ref"]
    assert 0 < kl_after[3.0] < 0.5 * kl_after[1e-4], kl_after


@pytest.mark.parametrize("step_without_signal", [False, True])
def test_a_batch_without_signal_leaves_the_weights_alone(step_without_signal, new_model_factory, tiny_tokenizer):
    """Every group's rewards equal: the gradient is 0, but Adam, once it has momentum, would still move
    the weights; only with ``step_without_signal`` does it."""
    backend = TorchBackend(new_model_factory(), TorchBackendConfig(lr=3e-3, step_without_signal=step_without_signal))
    model = backend.model
    first = backend.step(_trajectories(model, tiny_tokenizer, [1.0] * 8, LENGTHS))
    assert first["updates_skipped"] == 0.0  # no signal, but an optimizer without state steps: its state exists
    backend.step(_trajectories(model, tiny_tokenizer, REWARDS, LENGTHS))  # a real update: Adam has momentum
    flat = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    before = {k: v.clone() for k, v in backend.state_dict().items()}
    figures = backend.step(_trajectories(model, tiny_tokenizer, flat, LENGTHS))
    moved = max(float((v - before[k]).abs().max()) for k, v in backend.state_dict().items())
    assert figures["zero_adv_frac"] == 1.0 and figures["grad_norm"] == 0.0 and figures["loss"] == 0.0
    assert {"entropy", "clip_frac", "behav_kl"} <= set(figures)  # the diagnostics come all the same
    if step_without_signal:
        assert moved > 1e-4 and figures["updates_skipped"] == 0.0
    else:
        assert moved == 0.0 and figures["updates_skipped"] == 1.0
        # a batch with signal steps again
        assert backend.step(_trajectories(model, tiny_tokenizer, REWARDS, LENGTHS))["updates_skipped"] == 0.0


@pytest.fixture
def new_model_factory(tiny_checkpoint):
    from astraflow.models import load_model

    return lambda: load_model(tiny_checkpoint)


# -- the recipe ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("objective", "expected"), [
    ({"advantage": "rlo"}, r"objective\.advantage.*'grpo', 'dr_grpo', 'rloo' or 'reinforce_pp'"),
    ({"entropy_coeff": 0.01}, r"objective\.entropy_coeff.*[Ee]xtra inputs"),
    ({"kl": {"coef": 0.1, "estimator": "k2"}}, r"objective\.kl\.estimator"),
    ({"aggregation": "seq_mean_token_sum"}, r"norm_tokens is required"),
    ({"dual_clip": 0.9}, r"objective\.dual_clip"),
])
def test_a_misspelt_objective_is_refused_at_recipe_load(tmp_path, objective, expected):
    from astraflow.recipe import Recipe

    path = tmp_path / "r.yaml"
    recipe = yaml.safe_load(Path("examples/recipes/math.yaml").read_text())
    recipe["policies"][0]["model"] = "examples/models/tiny.yaml"
    recipe["policies"][0]["backend"]["objective"] = objective
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError, match=expected):
        Recipe.load(path)


def test_the_example_recipe_with_a_non_default_objective_loads():
    from astraflow.recipe import Recipe

    obj = Recipe.load("examples/recipes/math_dr_grpo.yaml").policy("policy").backend.objective
    assert obj.advantage == "dr_grpo" and obj.aggregation == "seq_mean_token_sum"
