"""The ``tasks: teacher`` family of the LoRA-ML learner: labels are a deterministic function of the seed,
every task is the shared teacher plus a rank-k change of one layer, the teacher's base plus a fresh rank-k
LoRA fits the new task where an untrained base cannot, and the floor / ceiling methods, validation,
federated nodes work (issue #30)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from flwr.app import RecordDict

from clients.lora_meta import STATE_KEY, LoraMetaLearner
from clients.peft_meta.adaptation import evaluate_new_task
from clients.peft_meta.environment import scores
from clients.peft_meta.teacher import teacher_base, teacher_labels
from fedsim import config as C
from fedsim.contracts.learner import NodeContext
from fedsim.engine.runtime import RunSpec, get_learner
from fedsim.errors import ConfigError

FAST = ["client.params.ft_repeats=1", "client.params.curve_points=[0]"]


def teacher_learner(*overrides: str, clients: int = 1, rounds: int = 2) -> LoraMetaLearner:
    cfg = C.load_config("peft_meta_teacher", [*FAST, *overrides], {"rounds": rounds, "clients": clients})
    cfg.tracking.enabled = False
    cfg.engine.checkpoint = False
    learner = get_learner(RunSpec.from_config(cfg))
    learner.preflight()
    return learner


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: one intra-op thread (as a run's client) is faster than several on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def learner(one_thread: None) -> LoraMetaLearner:
    return teacher_learner()


def test_labels_are_a_deterministic_function_of_the_seed(learner: LoraMetaLearner) -> None:
    again = teacher_learner()
    for a, b in zip([*learner.tasks, learner.new_task], [*again.tasks, again.new_task]):
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
        assert torch.equal(a.y_test, b.y_test)
    assert torch.equal(learner.new_task.y_val, again.new_task.y_val)  # type: ignore[arg-type]
    other = teacher_learner("seed=1")
    assert not torch.equal(other.tasks[0].y_train, learner.tasks[0].y_train)
    # the labels are the teacher's: relabelling the stored inputs reproduces them
    for t, task in enumerate(learner.tasks):
        assert torch.equal(teacher_labels(learner.env.teacher, task.x_train, t), task.y_train)
        assert 0.4 <= float(task.y_train.float().mean()) <= 0.6  # balanced by construction (±sampling)


@pytest.mark.parametrize("layer, k, scale", [(-1, 1, 2.0), (0, 2, 1.0)])
def test_every_task_is_the_shared_teacher_plus_a_rank_k_change_of_the_stated_layer(
        learner: LoraMetaLearner, layer: int, k: int, scale: float) -> None:
    if (layer, k, scale) != (learner.params.teacher_layer, learner.params.rank, learner.params.teacher_scale):
        learner = teacher_learner(f"client.params.teacher_layer={layer}", f"client.params.rank={k}",
                                  f"client.params.teacher_scale={scale}")
    teacher, T = learner.env.teacher, learner.params.num_tasks
    layers = teacher.lora_layers()
    stated = layers[layer]
    for other in layers:
        if other is not stated:  # every other layer: the shared weight for every task
            assert float(other.lora_b.detach().abs().sum()) == 0.0
    deltas = [stated.lora_b[t] @ stated.lora_a[t] for t in range(T + 1)]
    for t, d in enumerate(deltas):
        assert int(torch.linalg.matrix_rank(d.detach())) == k, t
    for t in range(T):  # the new task vs retraining task t: a change of rank <= 2k, and a real one
        diff = (deltas[T] - deltas[t]).detach()
        assert 0 < int(torch.linalg.matrix_rank(diff)) <= 2 * k
        assert float(diff.norm()) > 0.1 * float(stated.weight.detach().norm())


def test_the_teacher_base_fits_the_new_task_an_untrained_base_does_not(learner: LoraMetaLearner) -> None:
    env, new = learner.env, learner.new_task
    oracle, untrained = teacher_base(env.teacher), learner.init_arrays()
    # representable: the true base with the new task's own rank-k change is exact on the test split
    model = env.model(1)
    model.load_part(oracle)
    with torch.no_grad():
        for mine, its in zip(model.lora_layers(), env.teacher.lora_layers()):
            mine.lora_a[0].copy_(its.lora_a[-1])
            mine.lora_b[0].copy_(its.lora_b[-1])
    assert scores(model, new.x_test, new.y_test, torch.zeros(len(new.y_test), dtype=torch.long))[1] == 1.0
    # and a fresh rank-k LoRA fitted on the shots finds much of it; on an untrained base it cannot
    fit_oracle = evaluate_new_task(env, oracle)
    fit_untrained = evaluate_new_task(env, untrained)
    assert fit_oracle["new_task_acc"] >= 0.78, fit_oracle
    assert fit_untrained["new_task_acc"] <= fit_oracle["new_task_acc"] - 0.1, (fit_untrained, fit_oracle)
    assert "val/new_task_acc" in fit_oracle  # the validation split tuning selects on


def test_floor_and_ceiling_methods_do_not_train() -> None:
    oracle = teacher_learner("client.params.method=oracle")
    arrays = oracle.init_arrays()
    assert all(torch.equal(v, teacher_base(oracle.env.teacher)[k]) for k, v in arrays.items())
    reply = oracle.train(arrays, NodeContext(0, 1, 1, 0, RecordDict()))
    assert all(torch.equal(v, arrays[k]) for k, v in reply.arrays.items())
    untrained = teacher_learner("client.params.method=untrained")
    base = untrained.init_arrays()
    assert not all(torch.equal(v, arrays[k]) for k, v in base.items())  # the run seed's draw, not the teacher


def test_federated_client_is_a_task_and_keeps_its_adapters() -> None:
    learner = teacher_learner(clients=4, rounds=1)
    assert [learner.node_tasks(p) for p in range(4)] == [[0], [1], [2], [3]]
    state = RecordDict()
    arrays = learner.init_arrays()
    reply = learner.train(arrays, NodeContext(2, 4, 1, 0, state))
    assert STATE_KEY in state and set(reply.arrays) == set(arrays)
    assert reply.num_examples == len(learner.tasks[2].y_train)


@pytest.mark.parametrize("override, match", [
    (["client.params.arch=mixer"], "tasks=teacher needs dataset=mnist and arch=mlp"),
    (["client.params.teacher_layer=2"], "teacher_layer"),
    (["client.params.tasks=pairs", "client.params.method=oracle", "client.params.dataset=digits",
      "client.params.train_pairs=[[0,1],[2,3]]", "client.params.new_pair=[4,5]", "client.params.shots=4"],
     "method=oracle needs client.params.tasks=teacher"),
    (["client.params.tasks=bogus"], "client.params.tasks must be one of"),
])
def test_bad_teacher_settings_are_config_errors(override: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        teacher_learner(*override)
