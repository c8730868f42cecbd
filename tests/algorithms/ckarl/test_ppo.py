"""PPO's pieces against hand computations: the clipped loss, GAE, the flat MLP, action sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms.ckarl.ppo import MLP, PPOConfig, gae, ppo_loss, sample_actions


def test_ppo_loss_matches_a_hand_computation() -> None:
    new_lp = torch.tensor([-0.5, -1.0, -0.2])
    old_lp = torch.tensor([-0.7, -0.6, -0.2])
    adv = torch.tensor([1.0, -2.0, 4.0])
    new_v = torch.tensor([1.5, 0.0, 3.0])
    old_v = torch.tensor([1.0, 0.5, 2.0])
    ret = torch.tensor([2.0, -1.0, 2.5])
    ent = torch.tensor([0.6, 0.5, 0.4])
    cfg = PPOConfig(clip_coef=0.2, ent_coef=0.01, vf_coef=0.5)

    # by hand: normalised advantages (sample std), ratios, clipped surrogate
    a = [1.0, -2.0, 4.0]
    mean = sum(a) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in a) / 2)
    an = [(x - mean) / (std + 1e-8) for x in a]
    r = [math.exp(0.2), math.exp(-0.4), 1.0]
    clip = [min(max(x, 0.8), 1.2) for x in r]
    pg = sum(max(-A * x, -A * c) for A, x, c in zip(an, r, clip)) / 3
    # value: clipped around the old value by +-0.2, the max of both squared errors
    vu = [(1.5 - 2.0) ** 2, (0.0 + 1.0) ** 2, (3.0 - 2.5) ** 2]
    vc = [(1.2 - 2.0) ** 2, (0.3 + 1.0) ** 2, (2.2 - 2.5) ** 2]
    v = 0.5 * sum(max(x, y) for x, y in zip(vu, vc)) / 3
    expected = pg - 0.01 * 0.5 + 0.5 * v

    loss, stats = ppo_loss(new_lp, ent, new_v, old_lp, old_v, adv, ret, cfg)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert stats["pg_loss"] == pytest.approx(pg, rel=1e-6) and stats["v_loss"] == pytest.approx(v, rel=1e-6)
    assert stats["clipfrac"] == pytest.approx(2 / 3)  # exp(0.2) and exp(-0.4) leave [0.8, 1.2]

    plain = PPOConfig(clip_coef=0.2, clip_vloss=False, norm_adv=False)
    loss2, s2 = ppo_loss(new_lp, ent, new_v, old_lp, old_v, adv, ret, plain)
    pg2 = sum(max(-A * x, -A * c) for A, x, c in zip(a, r, clip)) / 3
    assert s2["pg_loss"] == pytest.approx(pg2, rel=1e-6)
    assert s2["v_loss"] == pytest.approx(0.5 * sum(vu) / 3, rel=1e-6)


def test_gae_matches_the_recursion_by_hand() -> None:
    # one env, 3 steps; obs[2] starts a new episode (step 1 was terminal)
    rewards = torch.tensor([[1.0], [1.0], [1.0]])
    values = torch.tensor([[0.5], [0.4], [0.3]])
    dones = torch.tensor([[0.0], [0.0], [1.0]])
    next_value, next_done = torch.tensor([0.2]), torch.tensor([0.0])
    g, lam = 0.9, 0.8
    d2 = 1.0 + g * 0.2 - 0.3
    a2 = d2
    d1 = 1.0 + 0.0 - 0.4  # terminal: no bootstrap
    a1 = d1
    d0 = 1.0 + g * 0.4 - 0.5
    a0 = d0 + g * lam * a1
    adv, ret = gae(rewards, values, dones, next_value, next_done, g, lam)
    np.testing.assert_allclose(adv[:, 0].numpy(), [a0, a1, a2], rtol=1e-6)
    np.testing.assert_allclose(ret.numpy(), (adv + values).numpy())


def test_flat_mlp_equals_torch_layers_and_cleanrl_init() -> None:
    mlp = MLP((4, 8, 8, 2))
    g = torch.Generator().manual_seed(0)
    flat = mlp.init(g, 0.01)
    assert flat.numel() == mlp.numel == 4 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2
    w0, b0, w1, b1, w2, b2 = mlp.tensors(flat)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 2))
    with torch.no_grad():
        for layer, (w, b) in zip(net[::2], ((w0, b0), (w1, b1), (w2, b2))):
            layer.weight.copy_(w)
            layer.bias.copy_(b)
    x = torch.randn(5, 4)
    torch.testing.assert_close(mlp.forward(flat, x), net(x))
    # orthogonal rows scaled by the gain (sqrt 2 hidden, 0.01 head), zero biases
    torch.testing.assert_close(w1 @ w1.t(), 2.0 * torch.eye(8), atol=1e-5, rtol=0)
    torch.testing.assert_close(w2 @ w2.t(), 1e-4 * torch.eye(2), atol=1e-7, rtol=0)
    torch.testing.assert_close(w0.t() @ w0, 2.0 * torch.eye(4), atol=1e-5, rtol=0)
    assert not any(b.any() for b in (b0, b1, b2))
    assert torch.equal(mlp.init(torch.Generator().manual_seed(0), 0.01), flat)


def test_sampled_actions_follow_the_policy() -> None:
    logits = torch.log(torch.tensor([[0.2, 0.8], [0.9, 0.1], [0.5, 0.5]])).repeat(4000, 1)
    a = sample_actions(logits, torch.Generator().manual_seed(1)).view(4000, 3).float()
    np.testing.assert_allclose(a.mean(0).numpy(), [0.8, 0.1, 0.5], atol=0.03)
    assert torch.equal(sample_actions(logits, torch.Generator().manual_seed(1)),
                       sample_actions(logits, torch.Generator().manual_seed(1)))


def test_defaults_are_cleanrl_ppo_cartpole_defaults() -> None:
    """``cleanrl/ppo.py``'s ``Args`` (CartPole-v1): the budget, not the settings, under-trained the old stream."""
    cleanrl = {"num_envs": 4, "num_steps": 128, "learning_rate": 2.5e-4, "anneal_lr": True, "gamma": 0.99,
               "gae_lambda": 0.95, "num_minibatches": 4, "update_epochs": 4, "norm_adv": True, "clip_coef": 0.2,
               "clip_vloss": True, "ent_coef": 0.01, "vf_coef": 0.5, "max_grad_norm": 0.5, "target_kl": None}
    cfg = PPOConfig()
    assert {k: getattr(cfg, k) for k in cleanrl} == cleanrl
    assert cfg.batch_size == 512 and cfg.minibatch_size == 128 and cfg.hidden == 64


def test_a_short_scratch_run_learns_plain_cartpole() -> None:
    """20,480 steps (40 PPO iterations) of from-scratch PPO on CartPole-v1: the greedy final policy balances
    for far longer than the initial one (a random-like policy lasts ~20 steps), and the training return rises."""
    from algorithms.ckarl.config import RLParams, build_method
    from algorithms.ckarl.evaluation import evaluate_returns, tail_mean, training_curve
    from algorithms.ckarl.node import run_stream, task_curves

    p = RLParams(method="scratch", tasks=["plain"], steps_per_task=20480, rounds_per_task=1, reference=False)
    arrays, records = run_stream(p, 0)
    m, task = build_method(p, 0), p.stream(0)[0].train
    before = evaluate_returns(m.actor_mlp, m.init_arrays()["actor"], task, 8, 1, greedy=True).mean()
    after = evaluate_returns(m.actor_mlp, m.task_actor(arrays, 0, 1), task, 8, 1, greedy=True).mean()
    curve = training_curve(task_curves(p, records)[0])
    assert before < 30 and after > 100, (before, after)  # seed 0: 9.6 -> 165.9
    assert tail_mean(curve) > 2 * curve[:4].mean(), curve  # seed 0: 22.3 -> 59.1 (sampled actions, entropy bonus)
