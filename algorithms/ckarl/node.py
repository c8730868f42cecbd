"""One node's round, the server's step, and the whole stream run directly (centralised, no engine).

* :func:`train_round` -- node ``partition`` in ``server_round``: task k = (round - 1) // rounds_per_task;
  on the task's first round the method's :meth:`~algorithms.ckarl.agent.Method.begin_task`, then
  ``iterations_per_round`` PPO iterations on the node's own instance of task k.  What the node must
  remember between rounds (its env, unfinished episodes, Adam moments) is a :class:`NodeState`,
  kept node-local by the learner (``ctx.state``); a node whose state belongs to another task (first
  round of a task, or a node not sampled for a while) starts a fresh env and optimiser.
* :func:`server_update` -- what the ``ckarl`` strategy does after FedAvg: trainable keys from the
  average, every other key (theta_base, the pool, stored copies ...) from the server's own copy,
  ``round`` set, and :meth:`~algorithms.ckarl.agent.Method.end_task` after a task's last round (CKA-RL's
  pool push and Adaptive Knowledge Merging happen here, on the server).
* :func:`run_stream` -- the same two steps in a plain loop for one node: the centralised run without
  Flower.  The engine with one client must give exactly this (tests/clients/test_rl_learner.py).
* :func:`reference` -- the from-scratch reference (method ``scratch`` through :func:`run_stream`,
  nominal physics, one node, one torch thread as the engine's default ``threads_per_client``, so a
  centralised ``scratch`` run reproduces it) trained once per (stream, PPO, schedule, seed) and cached on disk
  (:func:`fedsim.cache.cached_state`): its per-task training curves (FWT's baseline) and its final
  policies' evaluation returns (success thresholds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from algorithms.ckarl.agent import Method, PolicyAgent, StateDict
from algorithms.ckarl.ckarl import CKARL, mixing_weights
from algorithms.ckarl.config import RLParams, build_method
from algorithms.ckarl.evaluation import evaluate_returns
from algorithms.ckarl.ppo import RolloutState, anneal, collect, update
from envs.rl_tasks import CartPoleTask, client_task, env_state, make_vec_env, set_env_state
from fedsim.cache import cache_dir, cached_state, key_of
from fedsim.seeding import derive_seed
from fedsim.threads import torch_threads

__all__ = ["NodeState", "Reference", "node_task", "reference", "run_stream", "server_update", "train_round"]

LOSS_KEYS = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac")
REFERENCE_VERSION = 1  # bump when the reference's training or evaluation changes


@dataclass
class NodeState:
    """A node's memory between rounds of one task."""

    task: int
    env: dict[str, Any]  # envs.rl_tasks.env_state
    rollout: dict[str, np.ndarray]  # RolloutState.as_arrays
    optim: dict[str, torch.Tensor]  # Adam state, "<param index>/<name>"


def node_task(p: RLParams, seed: int, k: int, partition: int, num_nodes: int) -> CartPoleTask:
    """Node ``partition``'s instance of task ``k`` (the nominal task when it is the only node)."""
    task = p.stream(seed)[k].train
    std = p.client_physics_std if num_nodes > 1 else 0.0
    return client_task(task, seed, partition, k, std)


def _adam_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}/{name}": t.detach().clone() for i, s in opt.state_dict()["state"].items() for name, t in s.items()}


def _load_adam(opt: torch.optim.Optimizer, flat: dict[str, torch.Tensor]) -> None:
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        i, name = key.split("/")
        state.setdefault(int(i), {})[name] = t.clone()
    sd["state"] = state
    opt.load_state_dict(sd)


def train_round(p: RLParams, method: Method, arrays: StateDict, state: NodeState | None, server_round: int,
                partition: int, num_nodes: int, seed: int) -> tuple[StateDict, NodeState, dict[str, float]]:
    """One node's training round (see the module docstring); returns the arrays to send back, the
    node's state for its next round and the round's metrics (per-iteration curve included)."""
    k, r = divmod(server_round - 1, p.rounds_per_task)
    if r == 0:
        arrays = method.begin_task(arrays, k)
    if state is not None and state.task != k:
        state = None
    agent = PolicyAgent(method, arrays, k)
    mix_lr = p.ckarl.beta_lr
    optimizer = torch.optim.Adam(agent.param_groups(p.ppo.learning_rate, mix_lr), eps=1e-5)
    base_lrs = [p.ppo.learning_rate, mix_lr][: len(optimizer.param_groups)]
    envs = make_vec_env(node_task(p, seed, k, partition, num_nodes), p.ppo.num_envs)
    if state is None:
        obs, _ = envs.reset(seed=derive_seed(seed, "rl-env", k, partition) % 2**31)
        rollout = RolloutState.fresh(obs)
    else:
        envs.reset(seed=0)
        set_env_state(envs, state.env)
        rollout = RolloutState.from_arrays(state.rollout)
        _load_adam(optimizer, state.optim)
    generator = torch.Generator().manual_seed(derive_seed(seed, "rl-train", server_round, partition))
    ipr, ipt = p.iterations_per_round, p.iterations_per_task
    curve, counts, finished, losses = [], [], [], []
    for i in range(ipr):
        anneal(optimizer, base_lrs, r * ipr + i + 1, ipt, p.ppo.anneal_lr)
        batch, done = collect(agent, envs, rollout, p.ppo.num_steps, generator)
        losses.append(update(agent, optimizer, batch, p.ppo, generator))
        curve.append(float(np.mean(done)) if done else math.nan)
        counts.append(float(len(done)))
        finished += done
    new_state = NodeState(k, env_state(envs), rollout.as_arrays(), _adam_state(optimizer))
    envs.close()
    out = agent.result()
    metrics: dict[str, float] = {
        "ret": float(np.mean(finished)) if finished else math.nan,
        "episodes": float(len(finished)),
        "task": float(k),
        **{key: float(np.mean([s[key] for s in losses])) for key in LOSS_KEYS},
        **{f"curve/{i}": v for i, v in enumerate(curve)},
        **{f"curve_n/{i}": v for i, v in enumerate(counts)},
    }
    if isinstance(method, CKARL):
        metrics.update(_mixing_metrics(method, out, k))
    return out, new_state, metrics


def _mixing_metrics(method: CKARL, arrays: StateDict, k: int) -> dict[str, float]:
    """The mixing weights alpha_k over the pool slots (NaN for unused slots and in task 0)."""
    alpha = [math.nan] * method.capacity
    if k > 0:
        n = method.pool_size(arrays)
        scale = arrays["scale"] if method.cfg.alpha_scale else 1.0
        with torch.no_grad():
            alpha[:n] = mixing_weights(arrays["beta"], n, scale).tolist()
    return {f"alpha/{s}": float(a) for s, a in enumerate(alpha)}


def server_update(method: Method, p: RLParams, previous: StateDict, averaged: StateDict,
                  server_round: int) -> StateDict:
    """The server's step after averaging (see the module docstring)."""
    k, r = divmod(server_round - 1, p.rounds_per_task)
    trainable = set(method.trainable_keys(k))
    out = {key: (averaged[key] if key in trainable else previous[key]) for key in previous}
    out["round"] = torch.tensor([float(server_round)])
    if r == p.rounds_per_task - 1:
        out = method.end_task(out, k)
    return out


def run_stream(p: RLParams, seed: int, method: str | None = None,
               threads: int = 1) -> tuple[StateDict, list[dict[str, float]]]:
    """The whole stream for one node, centralised: final arrays and each round's metrics.

    ``threads``: torch's intra-op threads, as the engine's ``threads_per_client`` (the reduction order,
    hence the last bits, depends on it)."""
    m = build_method(p, seed, method)
    state, records = None, []
    with torch_threads(threads):
        arrays = m.init_arrays()  # the QR of the orthogonal init rounds differently with more threads
        for server_round in range(1, p.rounds + 1):
            out, state, metrics = train_round(p, m, arrays, state, server_round, 0, 1, seed)
            arrays = server_update(m, p, arrays, out, server_round)
            records.append(metrics)
    return arrays, records


def task_curves(p: RLParams, per_round: list[dict[str, float]]) -> np.ndarray:
    """(tasks, iterations per task) training returns from one node's per-round metrics, in round order."""
    rows = [[m[f"curve/{i}"] for i in range(p.iterations_per_round)] for m in per_round]
    return np.asarray(rows, dtype=np.float64).reshape(p.num_tasks, p.iterations_per_task)


@dataclass
class Reference:
    """The from-scratch reference of a (stream, PPO, schedule, seed)."""

    curves: np.ndarray  # (tasks, iterations per task): mean episodic return per iteration (NaN: none ended)
    final_return: np.ndarray  # (tasks,): evaluation return of each task's final scratch policy

    def thresholds(self, success_frac: float) -> np.ndarray:
        return success_frac * self.final_return


def reference_key(p: RLParams, seed: int) -> str:
    return key_of(REFERENCE_VERSION, p.stream_config(), p.ppo, p.steps_per_task, p.rounds_per_task, p.reset_critic,
                  p.eval_episodes, p.eval_greedy, seed)


def eval_seed(seed: int, task: int) -> int:
    """The evaluation seed of task ``task``: the same for every policy evaluated on it (paired)."""
    return derive_seed(seed, "rl-eval", task) % 2**31


def reference(p: RLParams, seed: int) -> tuple[Reference, bool]:
    """The cached reference (built now if missing) and whether it came from the cache."""
    def build() -> dict[str, torch.Tensor]:
        arrays, records = run_stream(p, seed, "scratch")
        m = build_method(p, seed, "scratch")
        stream = p.stream(seed)
        with torch_threads(1):
            final = [evaluate_returns(m.actor_mlp, m.task_actor(arrays, j, p.num_tasks), stream[j].train,
                                      p.eval_episodes, eval_seed(seed, j), p.eval_greedy).mean()
                     for j in range(p.num_tasks)]
        return {"curves": torch.from_numpy(task_curves(p, records)), "final_return": torch.tensor(final)}

    state, cached = cached_state(cache_dir() / "rl-reference" / f"{reference_key(p, seed)}.pt", build)
    return Reference(state["curves"].numpy(), state["final_return"].numpy()), cached
