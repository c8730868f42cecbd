"""Vectorised DP-SGD cohorts (clients/vectorised.py + privacy/cohort.py) compute what each client's
sequential Opacus round computes: the same Poisson batches, the same noise draws, the same clipped
and noised steps, the same ledger metrics and privacy state."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict

from clients.supervised import DP_STATE, SupervisedLearner, SupervisedParams
from clients.vectorised import auto_vectorise, train_cohort, vectorise_unsupported
from fedsim import config as C
from fedsim.contracts.learner import NodeContext, StateDict
from fedsim.contracts.wire import PHOENIX, PHOENIX_RESET_ROUNDS, PHOENIX_SEED, PHOENIX_THETA, PROXIMAL_MU, TRANSFORM_KEY
from privacy.cohort import passes_batches, poisson_masks
from privacy.facade import round_seeds
from privacy.ledger import CLIENT_EPSILON, NOISE, SAMPLE_RATE, STEPS

N = 8
ORDER = [5, 2, 7, 0, 3, 1, 6, 4]
MLP = ["model.name=mlp", "model.params={hidden: [16]}"]
CNN = ["model.name=cnn", "model.params={channels: [4], hidden: 8}"]
DP = ["privacy.enabled=true", "privacy.epsilon=3.0", "privacy.accountant=rdp"]
ATOL = 1e-5  # relative to the largest weight: noisy momentum steps reach |w| ~ 3


def learner(*overrides: str) -> SupervisedLearner:
    cfg = C.load_config("fedavg_digits", [f"num_clients={N}", "tracking.enabled=false", "data.partition.name=dirichlet",
                                          "data.partition.alpha=0.5", "client.local_epochs=1", "client.momentum=0.9",
                                          "client.weight_decay=0.001", "client.batch_size=16", "rounds=3", *DP,
                                          *overrides], {})
    return SupervisedLearner(cfg, SupervisedParams())


def ctxs(server_round: int = 1, config: dict | None = None, states: list[RecordDict] | None = None) -> list[NodeContext]:
    return [NodeContext(partition_id=p, num_partitions=N, server_round=server_round, root_seed=0,
                        state=states[i] if states else RecordDict(),
                        config={"server-round": server_round, **(config or {})})
            for i, p in enumerate(ORDER)]


def perturbed(init: StateDict) -> list[StateDict]:
    g = torch.Generator().manual_seed(1)
    return [{k: v + 0.01 * i * torch.randn(v.shape, generator=g) for k, v in init.items()} for i in range(N)]


def assert_same(lrn: SupervisedLearner, arrays: list[StateDict], config: dict | None = None, chunk: int = 3,
                rounds: int = 1) -> None:
    """Sequential and vectorised rounds agree, round after round (the privacy state carries over)."""
    seq_states, vec_states = [RecordDict() for _ in ORDER], [RecordDict() for _ in ORDER]
    for r in range(1, rounds + 1):
        seq_ctx, vec_ctx = ctxs(r, config, seq_states), ctxs(r, config, vec_states)
        assert vectorise_unsupported(lrn, vec_ctx) is None
        seq = [lrn.train(a, c) for a, c in zip(arrays, seq_ctx)]
        vec = train_cohort(lrn, arrays, vec_ctx, chunk)
        for s, v, cs, cv in zip(seq, vec, seq_ctx, vec_ctx):
            assert v.num_examples == s.num_examples
            assert list(v.metrics) == list(s.metrics)
            for k in (STEPS, SAMPLE_RATE, NOISE, CLIENT_EPSILON, "local_steps"):
                assert v.metrics[k] == s.metrics[k], k  # the ledger's figures exactly
            for k in s.metrics:
                assert v.metrics[k] == pytest.approx(s.metrics[k], rel=1e-5, abs=1e-6), k
            assert cv.state[DP_STATE]["steps"] == cs.state[DP_STATE]["steps"]
            for k in s.arrays:
                gap = float((v.arrays[k] - s.arrays[k]).abs().max())
                assert gap <= ATOL * max(1.0, float(s.arrays[k].abs().max())), (r, k, gap)  # float rounding
        arrays = [res.arrays for res in seq]


def test_mlp_cohort_is_each_clients_opacus_round() -> None:
    lrn = learner(*MLP)
    sizes = {len(lrn.data.client_train(p).y) for p in ORDER}
    assert len(sizes) > 1 and len({lrn.privacy_plan(p).noise_multiplier for p in ORDER}) > 1  # each client its own σ
    assert_same(lrn, perturbed(lrn.init_arrays()), rounds=2)


def test_empty_batches_and_several_passes() -> None:
    # batch 2 over clients of ~100+ examples: q ~ 1/90, so some logical batches are empty (noise-only
    # steps), and 120 fixed steps span two passes of the loader for the smaller clients
    lrn = learner(*MLP, "client.batch_size=2", "client.local_steps=120")
    sizes = [len(lrn.data.client_train(p).y) for p in ORDER]
    assert min(passes_batches(n, 2) for n in sizes) < 120
    assert sum(int((~poisson_masks(n, 2, 120, round_seeds(c)[0]).any(1)).sum()) for n, c in zip(sizes, ctxs())) > 0
    assert_same(lrn, [lrn.init_arrays()] * N)


def test_physical_batches_change_nothing() -> None:
    lrn = learner(*MLP, "privacy.max_physical_batch_size=3")
    assert_same(lrn, [lrn.init_arrays()] * N)


def test_adam_proximal_and_fixed_noise() -> None:
    lrn = learner(*MLP, "client.optimizer=adam", "client.lr=0.01", "privacy.epsilon=null",
                  "privacy.noise_multiplier=0.7")
    assert_same(lrn, perturbed(lrn.init_arrays()), config={PROXIMAL_MU: 0.3}, chunk=8)


def test_tight_clipping_with_little_noise() -> None:
    lrn = learner(*MLP, "privacy.epsilon=null", "privacy.noise_multiplier=0.01", "privacy.max_grad_norm=0.05")
    assert_same(lrn, [lrn.init_arrays()] * N)


def test_cnn_with_a_transform() -> None:
    lrn = learner(*CNN)
    phoenix = {TRANSFORM_KEY: PHOENIX, PHOENIX_THETA: 0.5, PHOENIX_RESET_ROUNDS: 1, PHOENIX_SEED: 3}
    assert_same(lrn, [lrn.init_arrays()] * N, config=phoenix, chunk=4)


def test_noise_is_really_there() -> None:
    """A negative control: the same cohort with another noise seed ends elsewhere."""
    lrn = learner(*MLP)
    init = lrn.init_arrays()
    a = train_cohort(lrn, [init] * N, ctxs(), 8)
    b = train_cohort(lrn, [init] * N, [NodeContext(c.partition_id, N, 1, root_seed=1, config=c.config)
                                        for c in ctxs()], 8)
    assert all(float((x.arrays[k] - y.arrays[k]).abs().max()) > 1e-3 for x, y in zip(a, b) for k in x.arrays)


def test_ghost_clipping_and_exhausted_budgets_stay_sequential() -> None:
    assert "ghost" in (vectorise_unsupported(learner(*MLP, "privacy.grad_sample_mode=ghost"), ctxs()) or "")
    lrn = learner(*MLP, "rounds=1")  # σ calibrated for one round: a second one is over budget
    cohort = ctxs()
    train_cohort(lrn, [lrn.init_arrays()] * N, cohort, 8)
    reason = vectorise_unsupported(lrn, ctxs(2, states=[c.state for c in cohort]))
    assert reason is not None and "budget exhausted" in reason


def test_auto_vectorises_dp_cohorts_of_small_mlps_at_any_step_size(monkeypatch) -> None:
    import clients.vectorised as vectorised

    lrn = learner(*MLP)
    monkeypatch.setattr(vectorised, "AUTO_MAX_STEP_WORK", 1)  # the step-size bound does not apply under DP
    assert auto_vectorise(lrn, ctxs()) is None
    monkeypatch.setattr(vectorised, "AUTO_MAX_PARAMS", 10)  # the model-size bound does
    assert "trainable parameters" in (auto_vectorise(lrn, ctxs()) or "")
    assert "is not a layer" in (auto_vectorise(learner(*CNN), ctxs()) or "")  # convolutions stay one by one
