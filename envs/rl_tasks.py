"""Continual reinforcement-learning task streams on gymnasium's CartPole (CKA-RL's offline stream).

A task is CartPole with its physical constants scaled, plus optional *conflicts* that make transfer
non-trivial.  The recipe follows Sequoia (``lebrice/Sequoia``,
``sequoia/settings/rl/continual/tasks.py``: ``_ENV_TASK_ATTRIBUTES`` and
``make_task_for_classic_control_env``): the first task is CartPole's default physics, every later
task multiplies ``gravity, masscart, masspole, length, force_mag, tau`` by seeded factors drawn from
N(1, 0.2) (research notes ``continual.md`` §1 "INFERRED", §6).  Conflicts (named per task):

* ``swap``: the two actions are exchanged (push left <-> push right);
* ``flip``: the signs of the pole angle and angular velocity (observation dims 2, 3) are flipped, so
  the same pole state reads as its mirror image (the cart dims keep their sign);
* ``swap_flip``: both.  ``plain``: neither.

Negating *every* observation dim together with ``swap`` would be CartPole's mirror symmetry (the
same task), which is why ``flip`` touches the pole dims only.

Federated variant: :func:`client_task` gives one node its own instance of a task, the task's
constants times a further seeded factor N(1, ``std``) per (node, task).

Environments are gymnasium's: ``gym.make("CartPole-v1")`` (its 500-step ``TimeLimit``), the
conflicts as gymnasium's ``TransformAction`` / ``TransformObservation`` wrappers, and a
``SyncVectorEnv`` in *same-step* autoreset mode (the semantics CleanRL's PPO was written for: the
observation returned with ``terminated | truncated`` is already the next episode's first one).
:func:`env_state` / :func:`set_env_state` snapshot and restore a vector env exactly (each copy's
physical state, step counter and random generator), so a node can resume an unfinished episode in
its next round on any worker.

Deviations: Sequoia draws unclipped factors; here they are clipped to [0.5, 2] so no constant can
reach zero or flip sign.  The conflicts are this module's additions (the notes' suggestion).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers import TimeLimit, TransformAction, TransformObservation

from envs.streams import Task, TaskStream
from fedsim.errors import ConfigError
from fedsim.seeding import numpy_rng

__all__ = [
    "CONFLICTS",
    "DEFAULT_PHYSICS",
    "DEFAULT_TASKS",
    "CartPoleStreamConfig",
    "CartPoleTask",
    "cartpole_stream",
    "client_task",
    "env_state",
    "make_env",
    "make_vec_env",
    "set_env_state",
]

#: CartPole's constants that tasks scale (Sequoia's ``_ENV_TASK_ATTRIBUTES[CartPoleEnv]``).
DEFAULT_PHYSICS: dict[str, float] = {"gravity": 9.8, "masscart": 1.0, "masspole": 0.1, "length": 0.5,
                                     "force_mag": 10.0, "tau": 0.02}
#: Conflict name -> (swap actions, flipped observation dims).
CONFLICTS: dict[str, tuple[bool, tuple[int, ...]]] = {
    "plain": (False, ()), "swap": (True, ()), "flip": (False, (2, 3)), "swap_flip": (True, (2, 3)),
}
#: The default 6-task stream: physics changes throughout, actions swapped in tasks 2 and 5 (so task
#: 5 can reuse task 2's knowledge), pole observations flipped in task 4.
DEFAULT_TASKS = ["plain", "plain", "swap", "plain", "flip", "swap"]
FACTOR_RANGE = (0.5, 2.0)
MAX_EPISODE_STEPS = 500  # CartPole-v1


@dataclass(frozen=True)
class CartPoleTask:
    """One CartPole variant: absolute physical constants and the conflicts applied to it."""

    name: str
    physics: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_PHYSICS))
    swap_actions: bool = False
    flip_dims: tuple[int, ...] = ()

    def factors(self) -> dict[str, float]:
        """Each constant relative to CartPole's default."""
        return {k: v / DEFAULT_PHYSICS[k] for k, v in self.physics.items()}


@dataclass
class CartPoleStreamConfig:
    """A CartPole task stream: one conflict name per task (its length is the number of tasks)."""

    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    physics_std: float = 0.2  # std of the multiplicative N(1, std) factors (Sequoia: 0.2)
    first_default: bool = True  # task 0 keeps CartPole's default constants (Sequoia)

    def validate(self, where: str = "stream") -> None:
        if not self.tasks:
            raise ConfigError(f"{where}.tasks is empty: give one conflict name per task, e.g. {DEFAULT_TASKS}")
        bad = [t for t in self.tasks if t not in CONFLICTS]
        if bad:
            raise ConfigError(f"{where}.tasks: unknown conflict {bad[0]!r}; use one of {', '.join(CONFLICTS)}")
        if not 0.0 <= self.physics_std <= 0.5:
            raise ConfigError(f"{where}.physics_std must be in [0, 0.5], got {self.physics_std}")


def _scaled(base: dict[str, float], rng: np.random.Generator, std: float) -> dict[str, float]:
    factors = np.clip(rng.normal(1.0, std, size=len(base)), *FACTOR_RANGE)
    return {k: float(v * f) for (k, v), f in zip(base.items(), factors)}


def cartpole_stream(cfg: CartPoleStreamConfig, seed: int) -> TaskStream:
    """The stream of ``cfg`` for ``seed``: a :class:`~envs.streams.TaskStream` whose ``train`` payloads
    are :class:`CartPoleTask` (``test`` is the same task).  Task k's factors come from ``(seed, k)``
    alone, so a longer stream extends a shorter one."""
    cfg.validate()
    tasks = []
    for k, conflict in enumerate(cfg.tasks):
        physics = dict(DEFAULT_PHYSICS)
        if k > 0 or not cfg.first_default:
            physics = _scaled(physics, numpy_rng(seed, "cartpole-task", k), cfg.physics_std)
        swap, flip = CONFLICTS[conflict]
        task = CartPoleTask(f"t{k}-{conflict}", physics, swap, flip)
        tasks.append(Task(task.name, train=task, test=task, info={"conflict": conflict, **task.factors()}))
    return TaskStream(tasks, name="cartpole")


def client_task(task: CartPoleTask, seed: int, client: int, index: int, std: float) -> CartPoleTask:
    """Node ``client``'s instance of task ``index``: the constants times N(1, ``std``) factors."""
    if std <= 0:
        return task
    return replace(task, physics=_scaled(task.physics, numpy_rng(seed, "cartpole-client", client, index), std))


def make_env(task: CartPoleTask) -> gym.Env:
    """``CartPole-v1`` with the task's constants and conflicts."""
    env = gym.make("CartPole-v1", disable_env_checker=True)
    core = env.unwrapped
    for k, v in task.physics.items():
        setattr(core, k, float(v))
    core.total_mass = core.masspole + core.masscart  # derived in CartPoleEnv.__init__
    core.polemass_length = core.masspole * core.length
    if task.swap_actions:
        env = TransformAction(env, lambda a: 1 - a, env.action_space)
    if task.flip_dims:
        sign = np.ones(env.observation_space.shape, dtype=np.float32)
        sign[list(task.flip_dims)] = -1.0
        env = TransformObservation(env, lambda o: (o * sign).astype(np.float32), env.observation_space)
    return env


def make_vec_env(task: CartPoleTask, num_envs: int) -> SyncVectorEnv:
    """``num_envs`` copies of the task in a same-step-autoreset ``SyncVectorEnv`` (reset it before use)."""
    return SyncVectorEnv([lambda: make_env(task) for _ in range(num_envs)], autoreset_mode=AutoresetMode.SAME_STEP)


def _time_limit(env: gym.Env) -> TimeLimit:
    while not isinstance(env, TimeLimit):
        env = env.env
    return env


def env_state(envs: SyncVectorEnv) -> dict[str, Any]:
    """Everything that decides a vector env's future (after ``reset``): each copy's physical state,
    episode step counter, post-termination counter and random generator (as JSON text)."""
    cores = [e.unwrapped for e in envs.envs]
    return {
        "state": np.stack([np.asarray(c.state, dtype=np.float64) for c in cores]),
        "elapsed": np.array([_time_limit(e)._elapsed_steps for e in envs.envs], dtype=np.int64),
        "beyond": np.array([-1 if c.steps_beyond_terminated is None else c.steps_beyond_terminated for c in cores],
                           dtype=np.int64),
        "rng": json.dumps([c.np_random.bit_generator.state for c in cores]),
    }


def set_env_state(envs: SyncVectorEnv, state: dict[str, Any]) -> np.ndarray:
    """Restore :func:`env_state` into a vector env of the same task (already reset); returns the current
    observations (the conflicts applied)."""
    rngs = json.loads(state["rng"])
    if len(rngs) != envs.num_envs:
        raise ConfigError(f"env state of {len(rngs)} copies cannot restore a vector env of {envs.num_envs}")
    obs = []
    for i, env in enumerate(envs.envs):
        core = env.unwrapped
        core.state = np.array(state["state"][i], dtype=np.float64)
        beyond = int(state["beyond"][i])
        core.steps_beyond_terminated = None if beyond < 0 else beyond
        core.np_random.bit_generator.state = rngs[i]
        _time_limit(env)._elapsed_steps = int(state["elapsed"][i])
        o = np.array(core.state, dtype=np.float32)
        obs.append(env.observation(o) if isinstance(env, TransformObservation) else o)
    return np.stack(obs)
