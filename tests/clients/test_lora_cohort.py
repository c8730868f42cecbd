"""LoRA cohorts (clients/lora_cohort.py) return what sequential ``learner.train`` does, dropout masks included."""

from __future__ import annotations

import pytest
import torch

from clients.lora_cohort import (LORA_CHUNK_TOKENS, lora_cohort_refusal, own_keys, physical_batches,
                                 train_lora_cohort)
from clients.supervised import SupervisedLearner, SupervisedParams
from fedsim import config as C
from fedsim.contracts.learner import NodeContext, StateDict, TrainResult
from fedsim.contracts.wire import LORA_TRAIN_A, PROXIMAL_MU
from privacy.facade import CLIENT_EPSILON

pytestmark = pytest.mark.usefixtures("one_thread")

N = 4
ORDER = [2, 0, 3, 1]
ATOL = 1e-5


def learner(*overrides: str, grad_clip: float | None = None) -> SupervisedLearner:
    cfg = C.load_config("fedsvd", [f"num_clients={N}", "tracking.enabled=false", "privacy.enabled=false",
                                   "data.params.max_len=12", "client.batch_size=4", "client.local_steps=3",
                                   "client.lr=0.5", *overrides], {})
    return SupervisedLearner(cfg, SupervisedParams(grad_clip=grad_clip))


def ctxs(config: dict | None = None) -> list[NodeContext]:
    return [NodeContext(partition_id=p, num_partitions=N, server_round=2, root_seed=0,
                        config={"server-round": 2, **(config or {})}) for p in ORDER]


def client_arrays(lrn: SupervisedLearner, distinct: bool) -> list[StateDict]:
    """The server's arrays per client: the same object for all, or each client's own adapters and head."""
    init = lrn.init_arrays()
    g = torch.Generator().manual_seed(3)
    base = {k: v for k, v in init.items() if "lora_B" not in k}
    with_b = {**base, **{k: 0.02 * torch.randn(v.shape, generator=g) for k, v in init.items() if "lora_B" in k}}
    if not distinct:
        return [with_b] * len(ORDER)
    own = set(own_keys(lrn.model))
    return [{k: (v + 0.01 * i * torch.randn(v.shape, generator=g) if k in own else v) for k, v in with_b.items()}
            for i in range(len(ORDER))]


def assert_same(lrn: SupervisedLearner, arrays: list[StateDict], cohort: list[NodeContext], chunk: int = 8) -> None:
    seq: list[TrainResult] = []
    for a, c in zip(arrays, cohort):
        seq.append(lrn.train(a, c))
    after_seq = torch.random.get_rng_state()
    together = train_lora_cohort(lrn, arrays, cohort, chunk)
    assert len(together) == len(seq)
    for s, t in zip(seq, together):
        assert t.num_examples == s.num_examples and list(t.metrics) == list(s.metrics)
        for k in s.metrics:
            assert t.metrics[k] == pytest.approx(s.metrics[k], rel=1e-5, abs=1e-6), k
        assert list(t.arrays) == list(s.arrays)
        for k in s.arrays:
            gap = float((t.arrays[k] - s.arrays[k]).abs().max())
            assert gap <= ATOL, (k, gap)
            assert float((s.arrays[k] - arrays[0][k]).abs().max()) > 10 * ATOL or "lora_A" in k  # it trained
    # left as the sequential round leaves the learner: the last client's weights, the generator's state
    last = lrn.model.state_dict()
    assert all(float((last[k] - together[-1].arrays[k]).abs().max()) <= ATOL for k in together[-1].arrays)
    assert torch.equal(torch.random.get_rng_state(), after_seq)


def test_a_lora_cohort_trains_each_client_as_the_sequential_round_does() -> None:
    lrn = learner()  # the backbone's dropout 0.1 is active: every mask must be the sequential one
    assert lrn.model.bert.config.hidden_dropout_prob == pytest.approx(0.1)
    assert lrn.model.bert.config.attention_probs_dropout_prob == pytest.approx(0.1)
    assert_same(lrn, client_arrays(lrn, distinct=False), ctxs({LORA_TRAIN_A: False}))  # FedSVD: B and the head


def test_own_adapters_lora_dropout_trained_a_and_chunks() -> None:
    lrn = learner("model.params.dropout=0.05", "model.params.train_head=true", grad_clip=0.5)
    cohort = ctxs({LORA_TRAIN_A: True})  # FedAvg-LoRA: A trains too
    assert_same(lrn, client_arrays(lrn, distinct=True), cohort, chunk=3)  # a chunk of 3, then 1


def test_a_mask_drawn_from_another_stream_would_show() -> None:
    """The comparison can fail: with the masks drawn from the wrong seeds the weights differ."""
    lrn = learner()
    arrays, cohort = client_arrays(lrn, distinct=False), ctxs()
    seq = [lrn.train(a, c) for a, c in zip(arrays, cohort)]
    shifted = [NodeContext(partition_id=c.partition_id, num_partitions=N, server_round=3, root_seed=0,
                           config=c.config) for c in cohort]  # other seeds (same data: one split per client)
    together = train_lora_cohort(lrn, arrays, shifted, 8)
    gaps = [max(float((t.arrays[k] - s.arrays[k]).abs().max()) for k in s.arrays) for s, t in zip(seq, together)]
    assert min(gaps) > 100 * ATOL


def test_refusals() -> None:
    lrn = learner()
    cohort = ctxs()
    assert lora_cohort_refusal(lrn, cohort, auto=False) is None
    assert lora_cohort_refusal(lrn, cohort, auto=True) is None  # a step of 4 x 12 positions: measured faster
    big = learner("client.batch_size=64", "data.params.max_len=32")
    assert "2048 token positions is past the 256" in lora_cohort_refusal(big, cohort, auto=True)
    assert lora_cohort_refusal(lrn, cohort[:1], auto=False) == "a cohort of one client"
    assert "FedProx" in lora_cohort_refusal(lrn, ctxs({PROXIMAL_MU: 0.1}), auto=False)
    mixed = ctxs()
    mixed[1] = NodeContext(partition_id=0, num_partitions=N, server_round=2, root_seed=0, config={LORA_TRAIN_A: False})
    assert lora_cohort_refusal(lrn, mixed, auto=False) == "the clients train different LoRA factors"
    dp = learner("privacy.enabled=true")
    assert lora_cohort_refusal(dp, cohort, auto=False) is None
    assert lora_cohort_refusal(dp, cohort, auto=True) is None  # physical batches of ~4 x 12 positions
    big_dp = learner("privacy.enabled=true", "client.batch_size=64", "data.params.max_len=32")
    assert "2048 token positions is past the 256" in lora_cohort_refusal(big_dp, cohort, auto=True)
    ghost = learner("privacy.enabled=true", "privacy.grad_sample_mode=ghost")
    assert "ghost clipping" in lora_cohort_refusal(ghost, cohort, auto=False)
    arrays = client_arrays(lrn, distinct=False)
    base_key = next(k for k in arrays[0] if k not in set(own_keys(lrn.model)))
    other = [dict(a) for a in arrays]
    other[2][base_key] = other[2][base_key] + 1.0
    with pytest.raises(ValueError, match="shared weight .* differs"):
        train_lora_cohort(lrn, other, cohort, 8)
    trained_key = next(k for k in own_keys(lrn.model) if "lora_B" in k)
    lacking = [dict(a) for a in arrays]
    del lacking[1][trained_key]  # sent to some clients only: which value a client starts from would depend on order
    with pytest.raises(ValueError, match="different keys"):
        train_lora_cohort(lrn, lacking, cohort, 8)
    for a in lacking:
        a.pop(trained_key, None)  # sent to none: the sequential round would carry the previous client's value over
    with pytest.raises(ValueError, match="lack trained weights"):
        train_lora_cohort(lrn, lacking, cohort, 8)
    assert LORA_CHUNK_TOKENS >= 12 * 4


def test_the_cohorts_draws_are_pytorchs_on_cpu(monkeypatch) -> None:
    """Off the CPU an adapter model's sequential round draws its masks through the cohort's mode
    (``client_draws``); on CPU, forced to do the same, it trains bit for bit as PyTorch's own kernels do."""
    import clients.lora_cohort as lora_cohort

    lrn = learner("model.params.dropout=0.05")
    arrays, cohort = client_arrays(lrn, distinct=True), ctxs()
    native = [lrn.train(a, c) for a, c in zip(arrays, cohort)]
    monkeypatch.setattr(lora_cohort, "NATIVE_DRAW_DEVICES", ())  # as on a GPU: the mode draws the masks
    through_mode = [lrn.train(a, c) for a, c in zip(arrays, cohort)]
    for n, m in zip(native, through_mode):
        assert n.metrics == m.metrics
        assert all(torch.equal(n.arrays[k], m.arrays[k]) for k in n.arrays)
    together = train_lora_cohort(lrn, arrays, cohort, 8)
    for m, t in zip(through_mode, together):
        assert max(float((m.arrays[k] - t.arrays[k]).abs().max()) for k in m.arrays) <= ATOL


# -- DP-SGD ------------------------------------------------------------------------------------------

def dp_learner(*overrides: str) -> SupervisedLearner:
    """FedSVD's DP-SGD at a small scale: Poisson batches of ~4 split into physical batches of at most 2."""
    return learner("privacy.enabled=true", "privacy.epsilon=8", "privacy.max_physical_batch_size=2", *overrides)


def test_a_dp_lora_cohort_is_opacus_round_client_by_client() -> None:
    """Each client's Opacus round (Poisson batches, physical pieces, per-example clipping, its own noise,
    the ledger) from the same seeds; fresh contexts for each path, since a round records its steps in them."""
    lrn = dp_learner("model.params.dropout=0.05")
    arrays = client_arrays(lrn, distinct=True)
    seq = [lrn.train(a, c) for a, c in zip(arrays, ctxs({LORA_TRAIN_A: False}))]
    after_seq = torch.random.get_rng_state()
    together = train_lora_cohort(lrn, arrays, ctxs({LORA_TRAIN_A: False}), 8)
    for s, t in zip(seq, together):
        assert t.num_examples == s.num_examples and list(t.metrics) == list(s.metrics)
        assert CLIENT_EPSILON in s.metrics and s.metrics["local_steps"] >= 3
        for k in s.metrics:
            assert t.metrics[k] == pytest.approx(s.metrics[k], rel=1e-5, abs=1e-6), k
        assert list(t.arrays) == list(s.arrays)
        for k in s.arrays:
            assert float((t.arrays[k] - s.arrays[k]).abs().max()) <= ATOL, k
            assert float((s.arrays[k] - arrays[0][k]).abs().max()) > 10 * ATOL  # it trained
    assert torch.equal(torch.random.get_rng_state(), after_seq)


def test_dp_noise_or_batches_from_other_seeds_would_show(monkeypatch) -> None:
    import clients.vectorised as vectorised  # where a cohort's Opacus round is drawn (private_round)

    lrn = dp_learner()
    arrays = client_arrays(lrn, distinct=False)
    seq = [lrn.train(a, c) for a, c in zip(arrays, ctxs({LORA_TRAIN_A: False}))]
    real = vectorised.round_seeds
    for swap in (lambda b, n: (b, n + 1), lambda b, n: (b + 1, n)):  # other noise, other Poisson batches
        monkeypatch.setattr(vectorised, "round_seeds", lambda ctx, swap=swap: swap(*real(ctx)))
        together = train_lora_cohort(lrn, arrays, ctxs({LORA_TRAIN_A: False}), 8)
        gaps = [max(float((t.arrays[k] - s.arrays[k]).abs().max()) for k in s.arrays) for s, t in zip(seq, together)]
        assert min(gaps) > 100 * ATOL


@pytest.mark.parametrize("m, most", [(1, 2), (5, 2), (7, 3), (64, 64), (65, 64), (130, 64)])
def test_physical_batches_are_opacus_batch_splitting(m, most) -> None:
    import math

    import numpy as np

    mask = torch.zeros(200, dtype=torch.bool)
    mask[torch.randperm(200, generator=torch.Generator().manual_seed(m))[:m]] = True
    ascending = mask.nonzero().view(-1).tolist()
    opacus = [s.tolist() for s in np.array_split(ascending, math.ceil(m / most))]  # BatchSplittingSampler
    assert [p.tolist() for p in physical_batches(mask, most)] == opacus
    assert physical_batches(torch.zeros(5, dtype=torch.bool), most) == []


def test_empty_poisson_batches_step_on_noise_alone_in_both_paths() -> None:
    """Batches of 1 in ~500 examples: many logical batches are empty.  The sequential path runs no forward
    on them (MiniLM cannot take zero rows) and both step on the noise alone."""
    from privacy.cohort import poisson_masks
    from privacy.facade import round_seeds

    lrn = dp_learner("client.batch_size=1")
    cohort = ctxs({LORA_TRAIN_A: False})
    steps = [lrn.dp.begin_round(c, len(lrn.data.client_train(c.partition_id, 2).y)).steps_per_round for c in cohort]
    empty = [int((poisson_masks(len(lrn.data.client_train(c.partition_id, 2).y), 1, s, round_seeds(c)[0]).sum(1) == 0)
                 .sum()) for c, s in zip(cohort, steps)]
    assert sum(empty) >= 3, empty
    arrays = client_arrays(lrn, distinct=False)
    seq = [lrn.train(a, c) for a, c in zip(arrays, cohort)]
    together = train_lora_cohort(lrn, arrays, ctxs({LORA_TRAIN_A: False}), 8)
    for s, t in zip(seq, together):
        assert t.metrics == pytest.approx(s.metrics, rel=1e-5, abs=1e-6)
        assert max(float((t.arrays[k] - s.arrays[k]).abs().max()) for k in s.arrays) <= ATOL
