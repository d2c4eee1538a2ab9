"""The trainer's loss ignores masked (tool / environment / template) tokens: TorchBackend's loss and
gradient on multi-turn trajectories equal an independent per-token reference computed here over
the unmasked tokens only, and the log-probs recorded on masked tokens change nothing."""

from __future__ import annotations

import copy
import math
import random

import pytest

torch = pytest.importorskip("torch")

from astraflow.records import Trajectory
from astraflow.trainer.backend import build_backend

VOCAB = 48
CFG = {"type": "torch", "lr": 1e-12, "max_grad_norm": 1e9, "clip_eps": 0.2, "is_cap": 2.0,
       "temperature": 0.7, "adv_eps": 1e-6}
"""No effective update, no gradient clipping: the step leaves the raw gradient in ``.grad``."""


@pytest.fixture(autouse=True)
def one_thread():
    """Two shared cores: one torch thread is much faster than two fighting other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=True)).float()


def multi_turn(rng: random.Random, model, group: str, index: int, reward: float) -> Trajectory:
    """A trajectory of model turns (mask 1, behaviour log-probs near the model's own) and
    observation turns (mask 0, log-prob 0), of random lengths."""
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 7))]
    response, mask, bounds = [], [], [0]
    for turn in range(rng.randint(2, 4) * 2 - 1):  # model, obs, model, ... ending on a model turn
        n = rng.randint(1, 5)
        response += [rng.randrange(VOCAB) for _ in range(n)]
        mask += [1 - turn % 2] * n
        bounds.append(len(response))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0] / CFG["temperature"]
        own = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1),
                                            torch.tensor(response)]
    logprobs = [float(lp) + rng.uniform(-1.0, 1.0) if m else 0.0 for lp, m in zip(own, mask, strict=True)]
    return Trajectory(episode_id=f"{group}/{index}", task_id=group, group_id=group, sample_index=index,
                      policy="agent", prompt_ids=prompt, response_ids=response, logprobs=logprobs,
                      versions=[0] * len(response), loss_mask=mask, reward=reward, turn_bounds=bounds)


def batch(model) -> list[Trajectory]:
    rng = random.Random(1)
    rewards = {"g1": [1.0, 0.0, 0.0, 1.0], "g2": [0.5, 0.0, 1.0]}
    return [multi_turn(rng, model, g, i, r) for g, rs in rewards.items() for i, r in enumerate(rs)]


def reference_loss(model, trajs: list[Trajectory]):
    """The GRPO / decoupled-PPO objective written out token by token, unmasked tokens only, each
    sequence on its own (no padding, no batching)."""
    groups: dict[str, list[float]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t.reward)
    stats = {g: (sum(rs) / len(rs), math.sqrt(sum((r - sum(rs) / len(rs)) ** 2 for r in rs) / len(rs)))
             for g, rs in groups.items()}
    total, count = torch.zeros(()), 0
    for t in trajs:
        mean, std = stats[t.group_id]
        adv = (t.reward - mean) / (std + CFG["adv_eps"])
        logits = model(torch.tensor([t.prompt_ids + t.response_ids])).logits[0] / CFG["temperature"]
        for j, (token, m, behav) in enumerate(zip(t.response_ids, t.loss_mask, t.logprobs, strict=True)):
            if not m:
                continue
            logp = torch.log_softmax(logits[len(t.prompt_ids) - 1 + j], -1)[token]
            ratio = torch.exp(logp - logp.detach())
            clipped = ratio.clamp(1 - CFG["clip_eps"], 1 + CFG["clip_eps"])
            surr = torch.minimum(ratio * adv, clipped * adv)
            weight = torch.exp(logp.detach() - behav).clamp(max=CFG["is_cap"])
            total = total + weight * surr
            count += 1
    return -total / count, count


def backend_step(model, trajs: list[Trajectory]):
    backend = build_backend(model, CFG)
    metrics = backend.step(trajs)
    return metrics, {n: p.grad.detach().clone() for n, p in backend.model.named_parameters()}


def test_backend_loss_and_gradient_match_the_unmasked_reference():
    model = tiny_model()
    trajs = batch(model)
    reference = copy.deepcopy(model)
    ref_loss, ref_tokens = reference_loss(reference, trajs)
    ref_loss.backward()
    metrics, grads = backend_step(model, trajs)
    assert sum(sum(t.loss_mask) for t in trajs) == ref_tokens == metrics["tokens"]
    assert any(m == 0 for t in trajs for m in t.loss_mask)
    assert metrics["loss"] == pytest.approx(float(ref_loss.detach()), abs=1e-6)
    for name, p in reference.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-7), name
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0


def test_masked_tokens_logprobs_change_nothing():
    trajs = batch(tiny_model())
    metrics, grads = backend_step(tiny_model(), trajs)
    wild = copy.deepcopy(trajs)
    rng = random.Random(2)
    for t in wild:
        t.logprobs = [lp if m else rng.choice([-1e4, -30.0, 5.0]) for lp, m in zip(t.logprobs, t.loss_mask, strict=True)]
    metrics2, grads2 = backend_step(tiny_model(), wild)
    assert metrics2["loss"] == metrics["loss"] and metrics2["tokens"] == metrics["tokens"]
    for name, g in grads.items():
        assert torch.equal(g, grads2[name]), name
    assert metrics2["is_weight_mean"] == metrics["is_weight_mean"]
