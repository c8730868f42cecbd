"""The ``lora_meta`` retraining methods as plug-ins: one round of a node's training, without DP and
under DP-SGD (``lora_ml``: base + node-local adapters; ``retrain``: the plain model; ``reptile``:
per-task inner SGD and an interpolated reply)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from clients.lora_meta_model import LoraNet
from clients.peft_meta.dp import Tally, TaskContext
from clients.peft_meta.environment import STATE_KEY, TaskEnvironment, adapter_norm
from clients.peft_meta.params import LoraMetaParams
from fedsim.contracts.learner import NodeContext, StateDict
from privacy.facade import DP_STATE, PrivateTrainer

Streams = list[Iterator[torch.Tensor]]


def train_step(opt: torch.optim.Optimizer, logits: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """One optimiser step on the cross-entropy of ``logits``; returns (loss, correct predictions)."""
    loss = F.cross_entropy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item(), int((logits.argmax(1) == y).sum())


def reptile_step_size(params: LoraMetaParams, rounds: int, server_round: int) -> float:
    """ε annealed linearly from ``reptile_lr`` (round 1) towards 0 (after the last round)."""
    return params.reptile_lr * (1.0 - (server_round - 1) / rounds)


@dataclass
class StepResult:
    """A node's round: the reply's arrays and the train diagnostics (plus the DP ledger's metrics)."""

    arrays: StateDict
    loss: float
    acc: float
    adapter_norm: float = 0.0
    ledger: dict[str, float] = field(default_factory=dict)


class TrainingMethod(ABC):
    """One retraining method on the node's tasks of a :class:`TaskEnvironment`."""

    name: ClassVar[str]
    #: True when the node trains its tasks' adapters (kept in ``ctx.state``) and evaluates through them.
    adapters: ClassVar[bool] = False

    def __init__(self, env: TaskEnvironment) -> None:
        self.env, self.params = env, env.params

    def node_model(self, arrays: StateDict, ctx: NodeContext | None, task_ids: list[int]) -> LoraNet:
        """The model the node trains and evaluates: with its adapters or the plain base."""
        return self.env.node_model(arrays, ctx, task_ids) if self.adapters else self.env.plain(arrays)

    def init_arrays(self) -> StateDict:
        """The round-0 base: the model drawn from the run seed."""
        return self.env.model(0).base_state()

    def dp_examples(self, task_ids: list[int]) -> int:
        """Rows of one DP-SGD run: the node's pooled task examples."""
        return self.env.train_examples(task_ids)

    def dp_tasks_per_run(self, task_ids: list[int]) -> int:
        """Tasks whose batches one DP-SGD run's logical batch holds."""
        return len(task_ids)

    @abstractmethod
    def train(self, arrays: StateDict, ctx: NodeContext, task_ids: list[int], streams: Streams) -> StepResult:
        """``local_steps`` steps per the method, one batch stream per task."""

    @abstractmethod
    def train_private(self, arrays: StateDict, ctx: NodeContext, task_ids: list[int], dp: PrivateTrainer,
                      tally: Tally) -> StepResult:
        """The same round as DP-SGD through ``dp`` (loss and diagnostics through ``tally``)."""


class _Joint(TrainingMethod):
    """Adam on the mean loss over one batch of every task the node holds."""

    def optimiser(self, model: LoraNet) -> torch.optim.Optimizer:
        p = self.params
        params = model.base_parameters() + (model.adapter_parameters() if self.adapters else [])
        return torch.optim.Adam(params, lr=p.lr, weight_decay=p.weight_decay)

    def keep_adapters(self, model: LoraNet, ctx: NodeContext) -> float:
        """Store the node's adapters in ``ctx.state`` (they never leave the node); returns their norm."""
        if not self.adapters:
            return 0.0
        ctx.state[STATE_KEY] = ArrayRecord(model.adapter_state())
        return adapter_norm(model)

    def train(self, arrays: StateDict, ctx: NodeContext, task_ids: list[int], streams: Streams) -> StepResult:
        """``local_steps`` Adam steps on the mean loss over one batch of every task (LoRA-ML: each
        task through its own adapter; retrain: the plain model on the pooled batch)."""
        model = self.node_model(arrays, ctx, task_ids)
        opt = self.optimiser(model)
        model.train()
        losses, correct, seen = [], 0, 0
        for _ in range(self.params.local_steps):
            x, y, slot = self.env.batch(task_ids, streams)
            loss, hits = train_step(opt, model(x, slot if self.adapters else None), y)
            losses.append(loss)
            correct += hits
            seen += len(y)
        return StepResult(model.base_state(), float(np.mean(losses)), correct / seen, self.keep_adapters(model, ctx))

    def train_private(self, arrays: StateDict, ctx: NodeContext, task_ids: list[int], dp: PrivateTrainer,
                      tally: Tally) -> StepResult:
        """``local_steps`` Poisson batches of the node's pooled task examples ``(x, y, task slot)``; the
        adapters are trained by the DP steps only (post-processing of the noised gradients)."""
        model = self.node_model(arrays, ctx, task_ids)
        x, y, slot = self.env.pooled(task_ids, "train")
        if not self.adapters:  # slot 0 for the plain model: Opacus records every forward input, so a tensor
            slot = torch.zeros(len(y), dtype=torch.long)
        result = dp.train_round(model, self.optimiser(model), (x, y, slot), ctx, num_examples=len(y),
                                loss=tally.loss_fn)
        return StepResult(model.base_state(), result.mean_loss, tally.acc, self.keep_adapters(model, ctx),
                          result.metrics)


class LoraML(_Joint):
    """LoRA-ML: base + the node's tasks' adapters, each task's batch through its own adapter."""

    name = "lora_ml"
    adapters = True


class Retrain(_Joint):
    """Standard retraining: the plain model on the pooled batches."""

    name = "retrain"


class Reptile(TrainingMethod):
    """Inner SGD from the received model on each task; reply θ + ε · mean_t(θ_t − θ)."""

    name = "reptile"

    def dp_examples(self, task_ids: list[int]) -> int:
        """Rows of one task's DP-SGD run (tasks are equal-sized)."""
        return min(len(self.env.tasks[t].y_train) for t in task_ids)

    def dp_tasks_per_run(self, task_ids: list[int]) -> int:
        return 1

    def inner(self, arrays: StateDict) -> tuple[LoraNet, torch.optim.Optimizer]:
        """A task's copy of the received base and its inner SGD."""
        model = self.env.plain(arrays)
        return model, torch.optim.SGD(model.base_parameters(), lr=self.params.reptile_inner_lr)

    @staticmethod
    def delta(arrays: StateDict, model: LoraNet) -> StateDict:
        """θ_t − θ of a task's adapted copy."""
        return {k: v - arrays[k] for k, v in model.base_state().items()}

    def reply(self, arrays: StateDict, deltas: list[StateDict], server_round: int) -> StateDict:
        """θ + ε_r · mean_t(θ_t − θ) over the tasks' adapted copies."""
        eps = reptile_step_size(self.params, self.env.cfg.rounds, server_round)
        return {k: arrays[k] + eps * torch.stack([d[k] for d in deltas]).mean(0) for k in arrays}

    def train(self, arrays: StateDict, ctx: NodeContext, task_ids: list[int], streams: Streams) -> StepResult:
        deltas: list[StateDict] = []
        losses, correct, seen = [], 0, 0
        for t, stream in zip(task_ids, streams):
            model, opt = self.inner(arrays)
            model.train()
            for _ in range(self.params.local_steps):
                idx = next(stream)
                x, y = self.env.tasks[t].x_train[idx], self.env.tasks[t].y_train[idx]
                loss, hits = train_step(opt, model(x), y)
                losses.append(loss)
                correct += hits
                seen += len(y)
            deltas.append(self.delta(arrays, model))
        return StepResult(self.reply(arrays, deltas, ctx.server_round), float(np.mean(losses)), correct / seen)

    def train_private(self, arrays: StateDict, ctx: NodeContext, task_ids: list[int], dp: PrivateTrainer,
                      tally: Tally) -> StepResult:
        """Each task's inner SGD is one DP-SGD run on that task's examples only.

        The tasks' examples are disjoint, so an example is in exactly one run: by parallel composition
        the node's round costs one run's ε (the same plan for every task: equal sizes), and the reply
        ``θ + ε_r · mean_t(θ_t − θ)`` is post-processing.  Every run starts from the same spent steps
        and the node's record advances by one run."""
        deltas: list[StateDict] = []
        spent = ctx.state[DP_STATE] if DP_STATE in ctx.state else None
        ledger: dict[str, float] = {}
        after = None
        for t in task_ids:
            sub = TaskContext(ctx.partition_id, ctx.num_partitions, ctx.server_round, ctx.root_seed,
                              config=ctx.config, task=t)
            if spent is not None:
                sub.state[DP_STATE] = spent
            model, opt = self.inner(arrays)
            x, y = self.env.tasks[t].x_train, self.env.tasks[t].y_train
            result = dp.train_round(model, opt, (x, y, torch.zeros(len(y), dtype=torch.long)), sub,
                                    num_examples=self.dp_examples(task_ids), loss=tally.loss_fn)
            tally.add_round(result.mean_loss)
            ledger, after = result.metrics, sub.state[DP_STATE]
            deltas.append(self.delta(arrays, model))
        ctx.state[DP_STATE] = after
        return StepResult(self.reply(arrays, deltas, ctx.server_round), tally.loss, tally.acc, 0.0, ledger)


class Untrained(TrainingMethod):
    """No retraining: every round replies the received base unchanged, so every round's new-task score
    is that of the untrained base drawn from the run seed (the floor: round 0 as a configuration)."""

    name = "untrained"

    def train(self, arrays: StateDict, ctx: NodeContext, task_ids: list[int], streams: Streams) -> StepResult:
        return StepResult({k: v.clone() for k, v in arrays.items()}, 0.0, 0.0)  # no training batch

    def train_private(self, arrays: StateDict, ctx: NodeContext, task_ids: list[int], dp: PrivateTrainer,
                      tally: Tally) -> StepResult:
        """Touches no private example (no DP step is spent)."""
        return self.train(arrays, ctx, task_ids, [])


class Oracle(Untrained):
    """The teacher family's ceiling: the base *is* the teacher's shared base (never retrained), so a
    rank-k LoRA on the layer the tasks change (``teacher_layer``) can represent the new task exactly."""

    name = "oracle"

    def init_arrays(self) -> StateDict:
        from clients.peft_meta.teacher import teacher_base

        return teacher_base(self.env.teacher)


#: The methods by ``client.params.method`` (the order of :data:`clients.peft_meta.params.METHODS`).
TRAINING_METHODS: dict[str, type[TrainingMethod]] = {
    m.name: m for m in (LoraML, Retrain, Reptile, Untrained, Oracle)}


def build_method(env: TaskEnvironment) -> TrainingMethod:
    """The plug-in for ``env.params.method``."""
    return TRAINING_METHODS[env.params.method](env)
