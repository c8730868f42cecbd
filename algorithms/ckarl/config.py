"""The typed settings of a continual-RL run (``client.params`` of the ``ckarl`` learner)."""

from __future__ import annotations

from dataclasses import dataclass, field

from algorithms.ckarl.agent import Layout, Method
from algorithms.ckarl.baselines import FineTune, FineTuneN, Scratch
from algorithms.ckarl.ckarl import CKARL, CKARLConfig
from algorithms.ckarl.ppo import PPOConfig
from envs.rl_tasks import DEFAULT_TASKS, CartPoleStreamConfig, cartpole_stream
from envs.streams import TaskStream
from fedsim.errors import ConfigError

__all__ = ["METHODS", "RLParams", "build_method"]

METHODS: dict[str, type[Method]] = {"ckarl": CKARL, "ft1": FineTune, "ftn": FineTuneN, "scratch": Scratch}


@dataclass
class RLParams:
    """``client.params`` of the ``ckarl`` learner."""

    method: str = "ckarl"  # ckarl | ftn | ft1 | scratch
    # the stream (envs.rl_tasks): one conflict per task (plain | swap | flip | swap_flip)
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    physics_std: float = 0.2  # task-to-task factors N(1, std) on CartPole's constants (Sequoia)
    client_physics_std: float = 0.05  # federated only: each node's own instance of every task
    # schedule: env steps per task on each node; a task lasts rounds_per_task rounds
    steps_per_task: int = 30720
    rounds_per_task: int = 3
    ppo: PPOConfig = field(default_factory=PPOConfig)
    ckarl: CKARLConfig = field(default_factory=CKARLConfig)
    reset_critic: bool = True  # re-initialise the critic at every task (paper; code's load_critic=False)
    # evaluation and metrics
    eval_episodes: int = 8  # episodes per (policy, task) evaluation, on the task's nominal physics
    eval_greedy: bool = False  # argmax actions instead of sampling
    success_frac: float = 0.8  # success = return >= success_frac x the from-scratch reference's final return
    smooth: int = 5  # moving-average window (iterations) of the training return before thresholding
    reference: bool = True  # train (or load) the from-scratch reference: success thresholds and FWT need it

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def iterations_per_task(self) -> int:
        return self.steps_per_task // self.ppo.batch_size

    @property
    def iterations_per_round(self) -> int:
        return self.iterations_per_task // self.rounds_per_task

    @property
    def rounds(self) -> int:
        return self.num_tasks * self.rounds_per_task

    def stream_config(self) -> CartPoleStreamConfig:
        return CartPoleStreamConfig(list(self.tasks), self.physics_std)

    def stream(self, seed: int) -> TaskStream:
        return cartpole_stream(self.stream_config(), seed)

    def layout(self) -> Layout:
        return Layout(obs_dim=4, n_actions=2, hidden=self.ppo.hidden, num_tasks=self.num_tasks)

    def validate(self, where: str = "client.params") -> None:
        if self.method not in METHODS:
            raise ConfigError(f"{where}.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        self.stream_config().validate(where)
        self.ppo.validate(f"{where}.ppo")
        self.ckarl.validate(f"{where}.ckarl")
        if not 0.0 <= self.client_physics_std <= 0.5:
            raise ConfigError(f"{where}.client_physics_std must be in [0, 0.5], got {self.client_physics_std}")
        if self.rounds_per_task < 1:
            raise ConfigError(f"{where}.rounds_per_task must be >= 1, got {self.rounds_per_task}")
        unit = self.ppo.batch_size * self.rounds_per_task
        if self.steps_per_task < unit or self.steps_per_task % unit:
            fit = max(unit, round(self.steps_per_task / unit) * unit)
            raise ConfigError(f"{where}.steps_per_task={self.steps_per_task} must be a positive multiple of "
                              f"num_envs x num_steps x rounds_per_task = {unit}; e.g. {fit}")
        if self.eval_episodes < 1 or self.smooth < 1:
            raise ConfigError(f"{where}.eval_episodes and {where}.smooth must be >= 1")
        if not 0.0 < self.success_frac <= 1.0:
            raise ConfigError(f"{where}.success_frac must be in (0, 1], got {self.success_frac}")


def build_method(p: RLParams, seed: int, method: str | None = None) -> Method:
    """The method of ``p`` (or ``method``) for run seed ``seed``."""
    name = method or p.method
    cls = METHODS[name]
    if cls is CKARL:
        return CKARL(p.layout(), seed, p.reset_critic, p.ckarl)
    return cls(p.layout(), seed, p.reset_critic)
