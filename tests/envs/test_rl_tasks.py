"""The CartPole task stream: seeded physics, conflicts that really change the task, exact env snapshots."""

from __future__ import annotations

import numpy as np
import pytest

from envs.rl_tasks import (
    DEFAULT_PHYSICS,
    FACTOR_RANGE,
    CartPoleStreamConfig,
    CartPoleTask,
    cartpole_stream,
    client_task,
    env_state,
    make_env,
    make_vec_env,
    set_env_state,
)
from fedsim.errors import ConfigError


def test_stream_is_reproducible_and_seeded() -> None:
    cfg = CartPoleStreamConfig(["plain", "swap", "flip", "swap_flip"])
    a, b, other = cartpole_stream(cfg, 3), cartpole_stream(cfg, 3), cartpole_stream(cfg, 4)
    assert [t.train for t in a] == [t.train for t in b]
    assert a[0].train.physics == DEFAULT_PHYSICS  # Sequoia: the first task is the default env
    assert all(a[k].train.physics != other[k].train.physics for k in range(1, 4))
    for t in a:
        f = np.array(list(t.train.factors().values()))
        assert (f >= FACTOR_RANGE[0]).all() and (f <= FACTOR_RANGE[1]).all()
    assert len({tuple(t.train.physics.values()) for t in a}) == 4  # every task its own physics
    assert [(t.train.swap_actions, t.train.flip_dims) for t in a] == [(False, ()), (True, ()), (False, (2, 3)),
                                                                      (True, (2, 3))]
    # task k depends on (seed, k) only: a longer stream extends a shorter one
    longer = cartpole_stream(CartPoleStreamConfig(["plain", "swap", "flip", "swap_flip", "plain"]), 3)
    assert [t.train.physics for t in longer][:4] == [t.train.physics for t in a]


def test_client_instances_are_seeded_noise_around_the_task() -> None:
    task = cartpole_stream(CartPoleStreamConfig(["plain", "plain"]), 0)[1].train
    assert client_task(task, 0, 1, 1, 0.0) is task
    c1, c1_again, c2 = client_task(task, 0, 1, 1, 0.05), client_task(task, 0, 1, 1, 0.05), client_task(task, 0, 2, 1, 0.05)
    assert c1 == c1_again and c1.physics != c2.physics and c1.physics != task.physics
    ratios = np.array([c1.physics[k] / task.physics[k] for k in task.physics])
    assert np.all(np.abs(ratios - 1) < 0.3)


def _run(env, actions, seed=0):
    obs, _ = env.reset(seed=seed)
    out = [obs]
    for a in actions:
        obs, *_ = env.step(a)
        out.append(obs)
    return np.array(out)


def test_physics_and_conflicts_change_the_dynamics_as_named() -> None:
    physics = {**DEFAULT_PHYSICS, "gravity": 15.0, "masspole": 0.2}
    env = make_env(CartPoleTask("t", physics))
    core = env.unwrapped
    assert core.gravity == 15.0 and core.total_mass == pytest.approx(1.2) and core.polemass_length == pytest.approx(0.1)
    actions = [0, 0, 1, 0, 1, 1, 0]
    plain = _run(make_env(CartPoleTask("p", physics)), actions)
    swapped = _run(make_env(CartPoleTask("s", physics, swap_actions=True)), [1 - a for a in actions])
    np.testing.assert_array_equal(plain, swapped)  # swap: action a acts as 1 - a
    flipped = _run(make_env(CartPoleTask("f", physics, flip_dims=(2, 3))), actions)
    np.testing.assert_array_equal(flipped[:, :2], plain[:, :2])
    np.testing.assert_array_equal(flipped[:, 2:], -plain[:, 2:])
    default = _run(make_env(CartPoleTask("d")), actions)
    assert not np.allclose(default, plain)  # the scaled constants change the trajectory


def test_env_snapshot_restores_exactly_across_episode_ends() -> None:
    task = cartpole_stream(CartPoleStreamConfig(["plain", "swap_flip"]), 1)[1].train
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 2, size=(400, 3))
    a = make_vec_env(task, 3)
    obs, _ = a.reset(seed=5)
    ends = 0
    for t in range(200):
        obs, _, term, trunc, _ = a.step(actions[t])
        ends += int(np.logical_or(term, trunc).sum())
    snap = env_state(a)
    b = make_vec_env(task, 3)
    b.reset(seed=123)
    np.testing.assert_array_equal(set_env_state(b, snap), obs)
    for t in range(200, 400):
        ra, rb = a.step(actions[t]), b.step(actions[t])
        for x, y in zip(ra[:4], rb[:4]):
            np.testing.assert_array_equal(x, y)
        ends += int(np.logical_or(ra[2], ra[3]).sum())
    assert ends > 10  # random actions end many episodes: the restored RNG drives the resets


def test_bad_stream_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown conflict 'mirror'"):
        cartpole_stream(CartPoleStreamConfig(["plain", "mirror"]), 0)
    with pytest.raises(ConfigError, match="empty"):
        cartpole_stream(CartPoleStreamConfig([]), 0)


def test_vector_env_autoresets_in_the_same_step_and_collect_counts_episodes() -> None:
    """CleanRL's semantics: the observation returned with ``terminated | truncated`` is already the next
    episode's first one, and :func:`collect` reports each finished episode's return (= its length)."""
    import torch

    from algorithms.ckarl.ppo import MLP, FixedAgent, RolloutState, collect

    task = cartpole_stream(CartPoleStreamConfig(["plain"]), 0)[0].train
    envs = make_vec_env(task, 4)
    obs, _ = envs.reset(seed=3)
    for _ in range(100):
        obs, reward, term, trunc, _ = envs.step(np.ones(4, dtype=np.int64))  # always push right: short episodes
        done = np.logical_or(term, trunc)
        assert np.all(reward == 1.0)
        if done.any():
            assert np.all(np.abs(obs[done]) <= 0.05)  # a fresh reset state, not the terminal one
    mlp = MLP((4, 8, 2))
    g = torch.Generator().manual_seed(0)
    agent = FixedAgent(mlp, mlp.init(g, 0.01), MLP((4, 8, 1)), MLP((4, 8, 1)).init(g, 1.0))
    obs, _ = envs.reset(seed=4)
    state = RolloutState.fresh(obs)
    batch, finished = collect(agent, envs, state, 64, torch.Generator().manual_seed(1))
    assert batch.obs.shape == (64, 4, 4) and len(finished) > 4
    # every step is in a finished episode or in one still running: lengths add up to 4 x 64 steps
    assert sum(finished) + state.ep_length.sum() == 4 * 64
    starts = batch.dones[1:].sum() + state.done.sum()
    assert starts == len(finished)
