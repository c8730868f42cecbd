"""The parts of the ``lora_meta`` learner: one plug-in per method name, the learner composing them,
pooled task data with its adapter slots, Reptile's interpolated reply."""

from __future__ import annotations

import torch

import clients.lora_meta as lora_meta
from clients.peft_meta.environment import TaskEnvironment
from clients.peft_meta.methods import TRAINING_METHODS, LoraML, Reptile, Retrain, build_method
from clients.peft_meta.params import METHODS
from tests.clients.test_lora_meta import learner_of


def test_every_method_name_has_its_plugin() -> None:
    assert tuple(TRAINING_METHODS) == METHODS == lora_meta.METHODS
    assert [m.adapters for m in (LoraML, Retrain, Reptile)] == [True, False, False]


def test_learner_composes_the_parts() -> None:
    learner = learner_of("client.params.method=reptile", clients=2)
    assert isinstance(learner.env, TaskEnvironment) and isinstance(learner.method, Reptile)
    assert isinstance(build_method(learner.env), Reptile)
    assert learner.tasks is learner.env.tasks and learner.node_tasks(1) == [1]


def test_pooled_examples_carry_their_task_slot() -> None:
    env = learner_of().env
    x, y, slot = env.pooled([0, 1], "test")
    n0, n1 = len(env.tasks[0].y_test), len(env.tasks[1].y_test)
    assert len(x) == len(y) == n0 + n1 and slot.tolist() == [0] * n0 + [1] * n1
    assert torch.equal(y[:n0], env.tasks[0].y_test)


def test_reptile_reply_interpolates_the_mean_delta() -> None:
    learner = learner_of("client.params.method=reptile", rounds=4)
    arrays = {"w": torch.zeros(3)}
    deltas = [{"w": torch.ones(3)}, {"w": 3 * torch.ones(3)}]
    eps = learner.reptile_step_size(2)
    assert eps == 0.75
    assert torch.allclose(learner.method.reply(arrays, deltas, 2)["w"], torch.full((3,), 2 * eps))
