"""What every continual-RL method shares: the actor-critic layout and the method contract.

A method keeps its whole state in a flat dict of tensors (the *arrays* the server holds and the
strategy averages): always ``critic`` (the value MLP's flat parameters) and ``round`` (the last
completed server round, set by :func:`algorithms.ckarl.node.server_update`), plus its own keys
(``actor``/``copies`` for the baselines; ``base``/``v``/``beta``/``pool``/... for CKA-RL).  Every key
has a fixed shape for the whole run, as FedAvg needs.

The contract (:class:`Method`) splits a task's life between node and server:

* node, first round of task k: :meth:`Method.begin_task` -- the task's starting point (critic
  re-initialised, CKA-RL's new v_k = 0 and beta_k, scratch's fresh actor), drawn from seeds of
  ``(run seed, k)`` only, so every node starts identically;
* node, every round: the keys :meth:`Method.trainable_keys` are optimised by PPO through
  :meth:`Method.actor` (the actor's flat parameters as a differentiable function of the arrays);
* server, every round: trainable keys are averaged, every other key is kept from the server's copy;
  after the task's last round :meth:`Method.end_task` stores what the task learnt (CKA-RL pushes v_k
  into the pool and merges; FT-N / scratch keep a copy);
* evaluation: :meth:`Method.task_actor` -- the policy the method would use on task j (task identity
  known, as in CompoNet's and CKA-RL's evaluations), :meth:`Method.latest_actor` -- the policy
  trained last, :meth:`Method.memory` -- stored actor parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from algorithms.ckarl.ppo import MLP, FixedAgent
from fedsim.seeding import torch_generator

StateDict = dict[str, Tensor]


@dataclass(frozen=True)
class Layout:
    """Sizes of the actor and critic (CleanRL's separate 64-64 tanh MLPs) and the stream length."""

    obs_dim: int
    n_actions: int
    hidden: int
    num_tasks: int

    @property
    def actor(self) -> MLP:
        return MLP((self.obs_dim, self.hidden, self.hidden, self.n_actions))

    @property
    def critic(self) -> MLP:
        return MLP((self.obs_dim, self.hidden, self.hidden, 1))


class Method(ABC):
    """A continual-learning method over a task stream (see the module docstring)."""

    name: str = ""

    def __init__(self, layout: Layout, seed: int, reset_critic: bool = True) -> None:
        self.layout = layout
        self.seed = seed
        self.reset_critic = reset_critic
        self.actor_mlp = layout.actor
        self.critic_mlp = layout.critic

    # -- initialisation (seeded by (run seed, task) only) ------------------------------------------
    def fresh_actor(self, k: int) -> Tensor:
        return self.actor_mlp.init(torch_generator(self.seed, "rl-actor", k), 0.01)

    def fresh_critic(self, k: int) -> Tensor:
        return self.critic_mlp.init(torch_generator(self.seed, "rl-critic", k), 1.0)

    def init_arrays(self) -> StateDict:
        return {"critic": self.fresh_critic(0), "round": torch.zeros(1), **self._init()}

    @abstractmethod
    def _init(self) -> StateDict:
        """The method's own keys at round 0."""

    def begin_task(self, arrays: StateDict, k: int) -> StateDict:
        """The arrays a node starts task ``k`` from (a new dict; tensors not in place)."""
        out = dict(arrays)
        if k > 0 and self.reset_critic:
            out["critic"] = self.fresh_critic(k)
        return out

    # -- training ------------------------------------------------------------------------------------
    @abstractmethod
    def trainable_keys(self, k: int) -> list[str]:
        """Keys optimised during task ``k`` (averaged by the server); every other key is frozen."""

    def mix_keys(self, k: int) -> list[str]:
        """Trainable keys with their own learning rate (CKA-RL's mixing logits)."""
        return []

    @abstractmethod
    def actor(self, arrays: StateDict, k: int) -> Tensor:
        """The actor's flat parameters while training task ``k`` (differentiable in the trainable keys)."""

    # -- server --------------------------------------------------------------------------------------
    def end_task(self, arrays: StateDict, k: int) -> StateDict:
        """After task ``k``'s last aggregation: store what the task learnt."""
        return arrays

    # -- evaluation ----------------------------------------------------------------------------------
    @abstractmethod
    def task_actor(self, arrays: StateDict, j: int, done: int) -> Tensor:
        """The actor for task ``j`` once ``done`` tasks are finished (the latest one for j >= done)."""

    def latest_actor(self, arrays: StateDict, done: int) -> Tensor:
        """The actor trained last (task ``done - 1``; the initial actor when ``done == 0``)."""
        return self.task_actor(arrays, max(done - 1, 0), done)

    @abstractmethod
    def memory(self, arrays: StateDict, done: int) -> int:
        """Actor parameters the method stores once ``done`` tasks are finished."""


class PolicyAgent:
    """PPO's view of a method during task ``k``: trainable leaves + the frozen arrays."""

    def __init__(self, method: Method, arrays: StateDict, k: int) -> None:
        self.method, self.k = method, k
        self.trainable = {key: arrays[key].detach().clone().requires_grad_(True) for key in method.trainable_keys(k)}
        # copies (not views of decoded message buffers, whose alignment can change BLAS rounding)
        self.frozen = {key: v.detach().clone() for key, v in arrays.items() if key not in self.trainable}

    def arrays(self) -> StateDict:
        return {**self.frozen, **self.trainable}

    def actor_params(self) -> Tensor:
        return self.method.actor(self.arrays(), self.k)

    def logits(self, obs: Tensor) -> Tensor:
        return self.method.actor_mlp.forward(self.actor_params(), obs)

    def value(self, obs: Tensor) -> Tensor:
        return self.method.critic_mlp.forward(self.trainable.get("critic", self.frozen.get("critic")), obs)

    def parameters(self) -> list[Tensor]:
        return list(self.trainable.values())

    def snapshot(self) -> FixedAgent:
        with torch.no_grad():
            critic = self.trainable.get("critic", self.frozen.get("critic"))
            return FixedAgent(self.method.actor_mlp, self.actor_params(), self.method.critic_mlp, critic)

    def param_groups(self, lr: float, mix_lr: float) -> list[dict]:
        mix = set(self.method.mix_keys(self.k))
        main = [t for key, t in self.trainable.items() if key not in mix]
        groups = [{"params": main, "lr": lr}]
        mixed = [t for key, t in self.trainable.items() if key in mix]
        if mixed:
            groups.append({"params": mixed, "lr": mix_lr})
        return groups

    def result(self) -> StateDict:
        """The arrays after training (detached copies of the trainable keys)."""
        return {**self.frozen, **{key: t.detach().clone() for key, t in self.trainable.items()}}
