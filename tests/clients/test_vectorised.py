"""Vectorised cohort training (clients/vectorised.py) returns what sequential ``learner.train`` does."""

from __future__ import annotations

import itertools

import pytest
import torch

from fedsim.contracts.learner import NodeContext, StateDict, TrainResult
from fedsim.contracts.wire import PROXIMAL_MU
from clients.supervised import SupervisedLearner, SupervisedParams, iterate_batches
from fedsim.contracts.wire import PHOENIX, PHOENIX_RESET_ROUNDS, PHOENIX_SEED, PHOENIX_THETA, TRANSFORM_KEY
import clients.vectorised as vectorised
from clients.vectorised import auto_vectorise, batch_schedule, train_cohort, vectorise_unsupported
from fedsim import config as C

N = 8
ORDER = [5, 2, 7, 0, 3, 1, 6, 4]  # a cohort in no particular order
MLP = ["model.name=mlp", "model.params={hidden: [32]}"]
CNN = ["model.name=cnn", "model.params={channels: [4, 8], hidden: 16}"]
ATOL = 1e-5


def learner(*overrides: str, grad_clip: float | None = None) -> SupervisedLearner:
    cfg = C.load_config("fedavg_digits", [f"num_clients={N}", "tracking.enabled=false", "data.partition.name=dirichlet",
                                          "data.partition.alpha=0.5", "client.local_epochs=1", "client.momentum=0.9",
                                          "client.weight_decay=0.001", *overrides], {})
    return SupervisedLearner(cfg, SupervisedParams(grad_clip=grad_clip))


def ctxs(config: dict | None = None, per_client: dict[int, dict] | None = None) -> list[NodeContext]:
    return [NodeContext(partition_id=p, num_partitions=N, server_round=1, root_seed=0,
                        config={"server-round": 1, **(config or {}), **(per_client or {}).get(p, {})})
            for p in ORDER]


def perturbed(init: StateDict, n: int) -> list[StateDict]:
    """Distinct received models per client (as a personalised strategy might send)."""
    g = torch.Generator().manual_seed(1)
    return [{k: v + 0.01 * i * torch.randn(v.shape, generator=g) for k, v in init.items()} for i in range(n)]


def assert_same(lrn: SupervisedLearner, arrays: list[StateDict], cohort: list[NodeContext], chunk: int = 3) -> None:
    seq: list[TrainResult] = [lrn.train(a, c) for a, c in zip(arrays, cohort)]
    vec = train_cohort(lrn, arrays, cohort, chunk)
    assert len(vec) == len(seq)
    for s, v in zip(seq, vec):
        assert v.num_examples == s.num_examples
        assert list(v.metrics) == list(s.metrics)
        assert v.metrics["local_steps"] == s.metrics["local_steps"]
        for k in s.metrics:
            assert v.metrics[k] == pytest.approx(s.metrics[k], rel=1e-5, abs=1e-6), k
        assert list(v.arrays) == list(s.arrays)
        for k in s.arrays:
            assert v.arrays[k].shape == s.arrays[k].shape and v.arrays[k].dtype == s.arrays[k].dtype
            gap = float((v.arrays[k] - s.arrays[k]).abs().max())
            assert gap <= ATOL, (k, gap)
    last = lrn.model.state_dict()  # the learner's model is left as sequential training leaves it
    assert all(torch.equal(last[k], vec[-1].arrays[k]) for k in last)


def test_batch_schedule_is_iterate_batches() -> None:
    for n, b, steps in [(37, 8, 13), (5, 16, 4), (16, 16, 3), (40, 7, 6)]:
        got = batch_schedule(n, b, steps, seed=11)
        want = list(itertools.islice(iterate_batches(n, b, torch.Generator().manual_seed(11)), steps))
        assert got.shape == (steps, b)
        for row, w in zip(got, want):
            assert torch.equal(row[row >= 0], w) and bool((row[len(w):] == -1).all())


def test_mlp_matches_sequential_with_unequal_clients_and_chunks() -> None:
    lrn = learner(*MLP)
    cohort = ctxs()
    assert len({lrn.data.client_train(c.partition_id).y.shape[0] for c in cohort}) > 1  # unequal sizes
    assert vectorise_unsupported(lrn, cohort) is None
    assert_same(lrn, perturbed(lrn.init_arrays(), N), cohort, chunk=3)


def test_cnn_matches_sequential() -> None:
    lrn = learner(*CNN)
    assert_same(lrn, [lrn.init_arrays()] * N, ctxs(), chunk=3)


def test_fixed_local_steps_span_several_epochs() -> None:
    lrn = learner(*MLP, "client.local_steps=25", "client.batch_size=32")
    assert_same(lrn, [lrn.init_arrays()] * N, ctxs(), chunk=5)


def test_proximal_term_for_some_clients() -> None:
    lrn = learner(*MLP)
    some = {p: {PROXIMAL_MU: 0.5 + 0.1 * p} for p in (5, 7, 3, 6)}  # the others train without it
    assert_same(lrn, perturbed(lrn.init_arrays(), N), ctxs(per_client=some), chunk=3)


def test_phoenix_reset_and_proximal_on_cnn() -> None:
    lrn = learner(*CNN)
    reset = {TRANSFORM_KEY: PHOENIX, PHOENIX_THETA: 0.25, PHOENIX_RESET_ROUNDS: 2.0}
    # six clients reset (each with its own seed), two do not; all have the proximal term
    cohort = ctxs({PROXIMAL_MU: 0.1}, per_client={p: {**reset, PHOENIX_SEED: 100 + p} for p in range(2, N)})
    vec = train_cohort(lrn, [lrn.init_arrays()] * N, cohort, 4)
    assert [r.metrics.get("reset_filters") for r in vec] == [3.0 if c.partition_id >= 2 else None for c in cohort]
    assert_same(lrn, [lrn.init_arrays()] * N, cohort, chunk=4)


def test_arrays_the_model_rejects_raise_as_in_sequential_training() -> None:
    lrn = learner(*MLP)
    arrays = dict(lrn.init_arrays())
    arrays.pop(next(iter(arrays)))
    with pytest.raises(RuntimeError, match="Missing key"):
        lrn.train(arrays, ctxs()[0])
    with pytest.raises(RuntimeError, match="Missing key"):
        train_cohort(lrn, [arrays] * N, ctxs(), 4)


def test_grad_clip_and_adam() -> None:
    lrn = learner(*MLP, grad_clip=0.3)  # small enough to clip most steps
    assert_same(lrn, [lrn.init_arrays()] * N, ctxs(), chunk=8)
    lrn = learner(*MLP, "client.optimizer=adam", "client.lr=0.01")
    assert vectorise_unsupported(lrn, ctxs()) is None
    assert_same(lrn, [lrn.init_arrays()] * N, ctxs(), chunk=3)


def test_chunk_of_one_and_cohort_of_one() -> None:
    lrn = learner(*MLP)
    assert_same(lrn, [lrn.init_arrays()] * N, ctxs(), chunk=1)
    assert_same(lrn, [lrn.init_arrays()], ctxs()[:1], chunk=256)


class OtherLoss(SupervisedLearner):
    def loss(self, model, xb, yb, ctx):  # type: ignore[no-untyped-def]
        return super().loss(model, xb, yb, ctx) * 2


@pytest.mark.parametrize("overrides, needle", [
    (["privacy.enabled=true", "privacy.noise_multiplier=1.0", "privacy.grad_sample_mode=ghost"], "ghost"),
    ([*CNN[:1], "model.params={channels: [4], hidden: 8, norm: batch}"], "BatchNorm"),
    ([*MLP[:1], "model.params={hidden: [8], dropout: 0.2}"], "dropout"),
])
def test_unsupported_cohorts_say_why(overrides: list[str], needle: str) -> None:
    lrn = learner(*overrides)
    reason = vectorise_unsupported(lrn, ctxs())
    assert reason is not None and needle in reason
    with pytest.raises(ValueError, match="cannot vectorise"):
        train_cohort(lrn, [lrn.init_arrays()] * N, ctxs(), 4)


def test_subclass_with_another_loss_is_unsupported() -> None:
    cfg = learner(*MLP).cfg
    assert "loss" in (vectorise_unsupported(OtherLoss(cfg, SupervisedParams()), ctxs()) or "")


def test_dropout_zero_is_supported() -> None:
    assert vectorise_unsupported(learner(*MLP[:1], "model.params={hidden: [8], dropout: 0.0}"), ctxs()) is None


class HiddenNoise(torch.nn.Module):
    """A random op no module check can see: vmap's randomness="error" must refuse it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5, training=True)


def test_random_ops_in_the_forward_pass_raise_instead_of_differing() -> None:
    lrn = learner(*MLP)
    lrn._model = torch.nn.Sequential(*lrn.model, HiddenNoise())
    assert vectorise_unsupported(lrn, ctxs()) is None
    with pytest.raises(RuntimeError, match="random operation"):
        train_cohort(lrn, [lrn.init_arrays()] * N, ctxs(), 4)


def test_adapter_models_are_unsupported() -> None:
    lrn = learner(*MLP)
    lrn.model.federated_keys = lambda include_base=False: []  # as the LoRA wrappers declare them
    assert "adapter" in (vectorise_unsupported(lrn, ctxs()) or "")


# -- engine.vectorise=auto --------------------------------------------------------------------------

def test_auto_vectorises_a_small_mlp_cohort() -> None:
    assert auto_vectorise(learner(*MLP), ctxs()) is None


def test_auto_keeps_convolutions_sequential() -> None:
    lrn = learner(*CNN)
    assert vectorise_unsupported(lrn, ctxs()) is None  # exact, but not measured faster
    reason = auto_vectorise(lrn, ctxs())
    assert reason is not None and "Conv2d" in reason and "engine.vectorise=true" in reason


def test_auto_keeps_big_steps_sequential(monkeypatch) -> None:
    lrn = learner(*MLP)  # 64*32+32 + 32*10+10 = 2,442 parameters, batch 32 at most
    params = sum(p.numel() for p in lrn.model.parameters())
    largest = max(len(lrn.data.client_train(c.partition_id, 1).y) for c in ctxs())
    work = params * min(largest, lrn.cfg.client.batch_size)
    monkeypatch.setattr(vectorised, "AUTO_MAX_STEP_WORK", work)
    assert auto_vectorise(lrn, ctxs()) is None
    monkeypatch.setattr(vectorised, "AUTO_MAX_STEP_WORK", work - 1)
    reason = auto_vectorise(lrn, ctxs())
    assert reason is not None and f"{work:,} parameter-examples" in reason


def test_auto_keeps_big_models_sequential(monkeypatch) -> None:
    lrn = learner(*MLP)
    params = sum(p.numel() for p in lrn.model.parameters())
    monkeypatch.setattr(vectorised, "AUTO_MAX_PARAMS", params)
    assert auto_vectorise(lrn, ctxs()) is None
    monkeypatch.setattr(vectorised, "AUTO_MAX_PARAMS", params - 1)
    reason = auto_vectorise(lrn, ctxs())
    assert reason is not None and f"{params:,} trainable parameters" in reason


def test_auto_needs_two_clients_and_an_exact_cohort() -> None:
    assert auto_vectorise(learner(*MLP), ctxs()[:1]) == "a cohort of one client"
    reason = auto_vectorise(learner(*MLP[:1], "model.params={hidden: [8], dropout: 0.2}"), ctxs())
    assert reason is not None and "dropout" in reason
