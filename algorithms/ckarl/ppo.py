"""PPO in the CleanRL style (``vwxyzjn/cleanrl``, ``cleanrl/ppo.py``), split into pure pieces.

* :class:`PPOConfig` -- CleanRL's CartPole defaults (4 envs x 128 steps, Adam lr 2.5e-4 annealed
  linearly over a task, eps 1e-5, gamma .99, GAE lambda .95, 4 minibatches x 4 epochs, advantage
  normalisation per minibatch, clip .2 for the ratio and the value, entropy .01, value .5, global
  grad-norm clip .5, 64-64 tanh MLPs, orthogonal init: sqrt 2 hidden, .01 policy head, 1 value head).
* :class:`MLP` -- an MLP whose parameters live in one flat vector (so knowledge vectors, pools and
  copies are plain tensors); :func:`MLP.forward` is ``F.linear`` over views of that vector.
* :func:`collect` -- one rollout of ``num_steps`` over a same-step-autoreset vector env, with the
  episode returns finished during it; :func:`gae` -- CleanRL's advantage recursion;
  :func:`ppo_loss` -- the clipped surrogate + (clipped) value + entropy loss of one minibatch, pure
  so a test checks it by hand; :func:`update` -- the epochs x minibatches of one iteration.

The agent is anything with ``logits(obs)``, ``value(obs)``, ``parameters()`` (the trainable leaves,
for the grad-norm clip) and ``snapshot()`` (a fixed copy to act with during a rollout), e.g.
:class:`algorithms.ckarl.agent.PolicyAgent`.  All randomness (actions, minibatch order) comes from an
explicit ``torch.Generator``, so a node's round is a pure function of its inputs.  As in CleanRL,
truncation at 500 steps counts as termination (no bootstrap).  Checked against CleanRL's own ``ppo.py``
(issue #30): on CartPole-v1 both reach the same returns per step budget (204,800 steps: smoothed final
training return 382 / 256 / 464 for CleanRL, 407 / 208 here, seeds 0-2 / 0-1); what under-trained the old
stream was its budget (30,720 steps per task, 6 % of CleanRL's 500,000), not these settings.
Deviation: CleanRL samples actions
with ``Categorical.sample`` and shuffles with NumPy's global generator; here inverse-CDF sampling
and ``torch.randperm`` on the given generator (same laws).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedsim.errors import ConfigError

__all__ = ["MLP", "Batch", "FixedAgent", "PPOConfig", "RolloutState", "anneal", "collect", "gae", "ppo_loss", "sample_actions",
           "update"]


@dataclass
class PPOConfig:
    """PPO hyperparameters (CleanRL ``ppo.py`` CartPole defaults; the paper's Table 5 agrees except 8 envs)."""

    num_envs: int = 4
    num_steps: int = 128
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True  # linear decay to 0 over each task (CleanRL over the run; each task is a run in CKA-RL)
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.2  # paper Table 5; the authors' run_ppo.py defaults to 0.1
    clip_vloss: bool = True
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    hidden: int = 64

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    def validate(self, where: str = "ppo") -> None:
        ints = {"num_envs": self.num_envs, "num_steps": self.num_steps, "num_minibatches": self.num_minibatches,
                "update_epochs": self.update_epochs, "hidden": self.hidden}
        for k, v in ints.items():
            if v < 1:
                raise ConfigError(f"{where}.{k} must be >= 1, got {v}")
        if self.batch_size % self.num_minibatches:
            raise ConfigError(f"{where}: num_envs x num_steps = {self.batch_size} must be divisible by "
                              f"num_minibatches = {self.num_minibatches}")
        if self.learning_rate <= 0 or self.clip_coef <= 0 or self.max_grad_norm <= 0:
            raise ConfigError(f"{where}: learning_rate, clip_coef and max_grad_norm must be > 0")
        if not (0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1):
            raise ConfigError(f"{where}: gamma must be in (0, 1] and gae_lambda in [0, 1]")


# --------------------------------------------------------------------------- flat-parameter MLP


class MLP:
    """Layer sizes ``(in, h, ..., out)``; parameters ``W0, b0, W1, b1, ...`` concatenated in one vector."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(int(s) for s in sizes)
        self.shapes: list[tuple[int, ...]] = []
        for a, b in zip(self.sizes[:-1], self.sizes[1:]):
            self.shapes += [(b, a), (b,)]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.numels)]).tolist()
        self.numel = int(self.offsets[-1])

    def slices(self) -> list[slice]:
        """One slice of the flat vector per tensor (weights and biases in layer order)."""
        return [slice(a, b) for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def layer_slice(self, layer: int) -> slice:
        """The weight and bias of layer ``layer``."""
        return slice(self.offsets[2 * layer], self.offsets[2 * layer + 2])

    def tensors(self, flat: Tensor) -> list[Tensor]:
        return [flat[s].view(shape) for s, shape in zip(self.slices(), self.shapes)]

    def forward(self, flat: Tensor, x: Tensor) -> Tensor:
        return self.forward_tensors(self.tensors(flat), x)

    @staticmethod
    def forward_tensors(t: Sequence[Tensor], x: Tensor) -> Tensor:
        """The forward pass from :meth:`tensors` already unpacked (rollouts unpack once)."""
        n = len(t) // 2
        for i in range(n):
            x = F.linear(x, t[2 * i], t[2 * i + 1])
            if i < n - 1:
                x = torch.tanh(x)
        return x

    def init(self, generator: torch.Generator, out_std: float) -> Tensor:
        """CleanRL's ``layer_init``: orthogonal weights (gain sqrt 2, ``out_std`` for the last layer), zero biases."""
        parts = []
        n = len(self.shapes) // 2
        for i in range(n):
            w = torch.empty(self.shapes[2 * i])
            _orthogonal(w, out_std if i == n - 1 else math.sqrt(2.0), generator)
            parts += [w.flatten(), torch.zeros(self.shapes[2 * i + 1])]
        return torch.cat(parts)


def _orthogonal(w: Tensor, gain: float, generator: torch.Generator) -> None:
    """``torch.nn.init.orthogonal_`` drawing from ``generator`` (same construction: QR of a Gaussian)."""
    rows, cols = w.shape
    flat = torch.randn(rows, cols, generator=generator)
    if rows < cols:
        flat = flat.t()
    q, r = torch.linalg.qr(flat)
    q = q * torch.sign(torch.diagonal(r))
    if rows < cols:
        q = q.t()
    with torch.no_grad():
        w.copy_(q * gain)


# --------------------------------------------------------------------------- rollouts


class Agent(Protocol):
    def logits(self, obs: Tensor) -> Tensor: ...
    def value(self, obs: Tensor) -> Tensor: ...
    def parameters(self) -> list[Tensor]: ...
    def snapshot(self) -> "Agent": ...  # a detached, fast copy for acting (parameters fixed during a rollout)


class FixedAgent:
    """An actor-critic with fixed parameters, unpacked once (what a rollout acts with)."""

    def __init__(self, actor: MLP, actor_flat: Tensor, critic: MLP, critic_flat: Tensor) -> None:
        self._actor = [t.detach() for t in actor.tensors(actor_flat.detach())]
        self._critic = [t.detach() for t in critic.tensors(critic_flat.detach())]

    def logits(self, obs: Tensor) -> Tensor:
        return MLP.forward_tensors(self._actor, obs)

    def value(self, obs: Tensor) -> Tensor:
        return MLP.forward_tensors(self._critic, obs)

    def parameters(self) -> list[Tensor]:
        return []

    def snapshot(self) -> "FixedAgent":
        return self


@dataclass
class RolloutState:
    """What carries over between iterations (and rounds): the env's current observations and
    done flags, and the running return and length of each copy's unfinished episode."""

    obs: np.ndarray
    done: np.ndarray
    ep_return: np.ndarray
    ep_length: np.ndarray

    @staticmethod
    def fresh(obs: np.ndarray) -> "RolloutState":
        n = len(obs)
        return RolloutState(obs.astype(np.float32), np.zeros(n, np.float32), np.zeros(n, np.float64),
                            np.zeros(n, np.int64))

    def as_arrays(self) -> dict[str, np.ndarray]:
        return {"obs": self.obs, "done": self.done, "ep_return": self.ep_return, "ep_length": self.ep_length}

    @staticmethod
    def from_arrays(a: dict[str, np.ndarray]) -> "RolloutState":
        # fresh copies: buffers decoded from a record may be misaligned, and BLAS rounds differently then
        return RolloutState(np.array(a["obs"], np.float32), np.array(a["done"], np.float32),
                            np.array(a["ep_return"], np.float64), np.array(a["ep_length"], np.int64))


@dataclass
class Batch:
    obs: Tensor  # (T, N, obs_dim)
    actions: Tensor  # (T, N) long
    logprobs: Tensor
    rewards: Tensor
    dones: Tensor
    values: Tensor
    next_value: Tensor  # (N,)
    next_done: Tensor  # (N,)


def sample_actions(logits: Tensor, generator: torch.Generator) -> Tensor:
    """One categorical draw per row by inverse CDF on ``generator``."""
    probs = torch.softmax(logits, dim=-1)
    u = torch.rand(logits.shape[0], 1, generator=generator)
    return (probs.cumsum(-1) < u).sum(-1).clamp_(max=logits.shape[-1] - 1)


def collect(agent: Agent, envs: Any, state: RolloutState, num_steps: int,
            generator: torch.Generator) -> tuple[Batch, list[float]]:
    """Run ``num_steps`` vector steps from ``state`` (updated in place); returns the batch and the
    returns of the episodes that ended during it (CleanRL's ``episodic_return``)."""
    n = len(state.obs)
    obs_buf = torch.zeros((num_steps, n, state.obs.shape[1]))
    act_buf = torch.zeros((num_steps, n), dtype=torch.long)
    logp_buf, rew_buf, done_buf, val_buf = (torch.zeros((num_steps, n)) for _ in range(4))
    finished: list[float] = []
    with torch.no_grad():
        agent = agent.snapshot()
        for t in range(num_steps):
            obs = torch.from_numpy(state.obs)
            obs_buf[t], done_buf[t] = obs, torch.from_numpy(state.done)
            logits = agent.logits(obs)
            action = sample_actions(logits, generator)
            logp_buf[t] = torch.log_softmax(logits, -1).gather(1, action[:, None])[:, 0]
            val_buf[t] = agent.value(obs).view(-1)
            act_buf[t] = action
            next_obs, reward, term, trunc, _ = envs.step(action.numpy())
            rew_buf[t] = torch.as_tensor(reward, dtype=torch.float32)
            done = np.logical_or(term, trunc)
            state.ep_return += reward
            state.ep_length += 1
            for i in np.flatnonzero(done):
                finished.append(float(state.ep_return[i]))
                state.ep_return[i], state.ep_length[i] = 0.0, 0
            state.obs, state.done = next_obs.astype(np.float32), done.astype(np.float32)
        next_obs = torch.from_numpy(state.obs)
        next_value = agent.value(next_obs).view(-1)
    return Batch(obs_buf, act_buf, logp_buf, rew_buf, done_buf, val_buf, next_value,
                 torch.from_numpy(state.done)), finished


def gae(rewards: Tensor, values: Tensor, dones: Tensor, next_value: Tensor, next_done: Tensor,
        gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """CleanRL's generalised advantage estimation: ``(advantages, returns)``, both (T, N).

    ``dones[t]`` flags that ``obs[t]`` starts a new episode (so step t-1 was terminal); truncations
    count as terminations, as in CleanRL's ``ppo.py``.
    """
    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        nonterminal = 1.0 - (next_done if t == T - 1 else dones[t + 1])
        next_v = next_value if t == T - 1 else values[t + 1]
        delta = rewards[t] + gamma * next_v * nonterminal - values[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv, adv + values


def ppo_loss(new_logprob: Tensor, entropy: Tensor, new_value: Tensor, old_logprob: Tensor, old_value: Tensor,
             advantages: Tensor, returns: Tensor, cfg: PPOConfig) -> tuple[Tensor, dict[str, float]]:
    """CleanRL's minibatch loss ``pg - ent_coef * entropy + vf_coef * v``, with its diagnostics.

    pg = mean max(-A r, -A clip(r, 1-c, 1+c)) with r = exp(new - old) and A normalised over the
    minibatch (``norm_adv``; std with Bessel's correction, + 1e-8); v = 0.5 mean max((V-R)^2,
    (V_old + clip(V - V_old, -c, c) - R)^2) with ``clip_vloss``, else 0.5 mean (V-R)^2.
    """
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    if cfg.norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    c = cfg.clip_coef
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - c, 1 + c)).mean()
    new_value = new_value.view(-1)
    if cfg.clip_vloss:
        unclipped = (new_value - returns) ** 2
        clipped = (old_value + torch.clamp(new_value - old_value, -c, c) - returns) ** 2
        v_loss = 0.5 * torch.max(unclipped, clipped).mean()
    else:
        v_loss = 0.5 * ((new_value - returns) ** 2).mean()
    ent = entropy.mean()
    loss = pg_loss - cfg.ent_coef * ent + cfg.vf_coef * v_loss
    with torch.no_grad():
        stats = {"pg_loss": float(pg_loss), "v_loss": float(v_loss), "entropy": float(ent),
                 "approx_kl": float(((ratio - 1) - logratio).mean()),
                 "clipfrac": float(((ratio - 1.0).abs() > c).float().mean())}
    return loss, stats


def anneal(optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], iteration: int, num_iterations: int,
           enabled: bool) -> None:
    """CleanRL's schedule: ``lr = (1 - (iteration - 1) / num_iterations) * base`` (iteration from 1)."""
    frac = 1.0 - (iteration - 1.0) / num_iterations if enabled else 1.0
    for group, lr in zip(optimizer.param_groups, base_lrs):
        group["lr"] = frac * lr


def update(agent: Agent, optimizer: torch.optim.Optimizer, batch: Batch, cfg: PPOConfig,
           generator: torch.Generator) -> dict[str, float]:
    """One PPO iteration's optimisation (``update_epochs`` x ``num_minibatches``); mean diagnostics."""
    adv, ret = gae(batch.rewards, batch.values, batch.dones, batch.next_value, batch.next_done, cfg.gamma,
                   cfg.gae_lambda)
    b_obs = batch.obs.reshape(-1, batch.obs.shape[-1])
    b_act, b_logp = batch.actions.reshape(-1), batch.logprobs.reshape(-1)
    b_adv, b_ret, b_val = adv.reshape(-1), ret.reshape(-1), batch.values.reshape(-1)
    params = agent.parameters()
    stats: list[dict[str, float]] = []
    for _ in range(cfg.update_epochs):
        order = torch.randperm(cfg.batch_size, generator=generator)
        kl = 0.0
        for start in range(0, cfg.batch_size, cfg.minibatch_size):
            mb = order[start:start + cfg.minibatch_size]
            logits = agent.logits(b_obs[mb])
            logp_all = torch.log_softmax(logits, -1)
            new_logp = logp_all.gather(1, b_act[mb][:, None])[:, 0]
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            loss, s = ppo_loss(new_logp, entropy, agent.value(b_obs[mb]), b_logp[mb], b_val[mb], b_adv[mb],
                               b_ret[mb], cfg)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            stats.append(s)
            kl = s["approx_kl"]
        if cfg.target_kl is not None and kl > cfg.target_kl:
            break
    return {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
