"""CKA-RL's pieces: theta' = theta_base + sum softmax(beta)_j V_j + v, the most-similar-pair merge that keeps
the pool at K_max, and the per-task policies rebuilt from the pool."""

from __future__ import annotations

import pytest
import torch

from algorithms.ckarl.agent import Layout
from algorithms.ckarl.ckarl import CKARL, CKARLConfig, fused_params, merge_slots, mixing_weights, most_similar_pair
from fedsim.errors import ConfigError

LAYOUT = Layout(obs_dim=4, n_actions=2, hidden=8, num_tasks=6)


def test_fused_params_is_the_papers_formula() -> None:
    g = torch.Generator().manual_seed(0)
    D, P, n = 7, 4, 3
    base, v, pool, beta = (torch.randn(D, generator=g), torch.randn(D, generator=g), torch.randn(P, D, generator=g),
                           torch.randn(P, generator=g))
    e = [torch.exp(beta[j]) for j in range(n)]
    expected = base + v + sum(e[j] / sum(e) * pool[j] for j in range(n))  # the unused row pool[3] plays no part
    torch.testing.assert_close(fused_params(base, pool, n, beta, v), expected)
    # the code's learnable scale s: softmax(beta * s)
    torch.testing.assert_close(mixing_weights(beta, n, 2.0), torch.softmax(2.0 * beta[:n], 0))


def _arrays(m: CKARL, pool_rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    a = m.init_arrays()
    a["pool"][:pool_rows] = torch.randn(pool_rows, m.actor_mlp.numel, generator=g)
    a["pool_n"] = torch.tensor([float(pool_rows)])
    a["v"] = torch.randn(m.actor_mlp.numel, generator=g)
    a["beta"][:pool_rows] = torch.randn(pool_rows, generator=g)
    return a


@pytest.mark.parametrize("encoder", ["fused", "frozen", "finetune"])
def test_training_actor_follows_the_formula_and_the_encoder_option(encoder: str) -> None:
    m = CKARL(LAYOUT, 0, cfg=CKARLConfig(encoder=encoder, alpha_scale=True))
    a = _arrays(m, 3)
    a["scale"] = torch.tensor([1.7])
    if encoder == "finetune":
        a["encoder"] = torch.randn(a["encoder"].shape)
    theta = m.actor(a, k=2)
    full = a["base"] + torch.softmax(1.7 * a["beta"][:3], 0) @ a["pool"][:3] + a["v"]
    enc = m.actor_mlp.layer_slice(0)
    torch.testing.assert_close(theta[enc.stop:], full[enc.stop:])
    first = {"fused": full[enc], "frozen": a["base"][enc], "finetune": a.get("encoder")}[encoder]
    torch.testing.assert_close(theta[enc], first)
    assert torch.equal(m.actor(a, k=0), a["base"])  # task 1 trains theta_base itself


def test_most_similar_pair_uses_cosine_not_distance() -> None:
    vecs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [10.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
    assert most_similar_pair(vecs) == (0, 2)  # parallel-ish though far apart; the zero vector has cosine 0
    assert most_similar_pair(torch.eye(3)) == (0, 1)  # all ties (0): the first pair, as the code's argmax
    merged, new_slot = merge_slots(vecs, 0, 2)
    torch.testing.assert_close(merged, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [5.5, 0.25, 0.0]]))
    assert new_slot == [2, 0, 2, 1]


def _push(m: CKARL, a: dict[str, torch.Tensor], k: int, v: torch.Tensor) -> dict[str, torch.Tensor]:
    a = m.begin_task(a, k)
    a["v"] = v
    return m.end_task(a, k)


def test_merging_keeps_the_pool_at_k_max_and_averages_the_most_similar_pair() -> None:
    m = CKARL(LAYOUT, 0, cfg=CKARLConfig(k_max=3))
    D = m.actor_mlp.numel
    g = torch.Generator().manual_seed(2)
    vs = {k: torch.randn(D, generator=g) for k in range(1, 6)}
    vs[3] = vs[1] * 3 + 0.01 * torch.randn(D, generator=g)  # v3 nearly parallel to v1
    a = m.end_task(m.init_arrays(), 0)
    sizes = []
    for k in range(1, 6):
        before = a["pool"][: m.pool_size(a)].clone()
        a = _push(m, a, k, vs[k])
        sizes.append(m.pool_size(a))
        if k == 3:  # pool [0, v1, v2] + v3 -> 4 > K_max: the most similar pair (v1, v3) merges into the last slot
            assert most_similar_pair(torch.cat([before, vs[3][None]])) == (1, 3)
            torch.testing.assert_close(a["pool"][2], (vs[1] + vs[3]) / 2)
            torch.testing.assert_close(a["pool"][:2], before[[0, 2]])
            assert m.merge_history(a)[:4] == [0, 2, 1, 2]  # null in slot 0, v2 in 1, v1 and v3 share slot 2
    assert sizes == [2, 3, 3, 3, 3]
    assert a["pool"].shape == (4, D) and not a["pool"][3].any()  # fixed shape; the spare row is empty
    assert m.memory(a, 6) == D + 3 * D  # theta_base + K_max vectors: flat after K_max tasks

    unbounded = CKARL(LAYOUT, 0, cfg=CKARLConfig(k_max=0))
    b = unbounded.end_task(unbounded.init_arrays(), 0)
    for k in range(1, 6):
        b = _push(unbounded, b, k, vs[k])
    assert unbounded.pool_size(b) == 6 and unbounded.memory(b, 6) == 7 * D


def test_task_policies_are_rebuilt_from_the_pool_exactly_until_a_merge_touches_them() -> None:
    m = CKARL(LAYOUT, 0, cfg=CKARLConfig(k_max=3))
    D = m.actor_mlp.numel
    g = torch.Generator().manual_seed(3)
    a = m.end_task(m.init_arrays(), 0)
    trained = {0: a["base"].clone()}
    for k in range(1, 4):
        a = m.begin_task(a, k)
        a["v"] = torch.randn(D, generator=g)
        a["beta"][: m.pool_size(a)] += torch.randn(m.pool_size(a), generator=g)
        trained[k] = m.actor(a, k).clone()  # theta'_k at the end of task k
        a = m.end_task(a, k)
        if k < 3:  # before any merge, every task's policy is exactly what it trained
            for j in range(k + 1):
                torch.testing.assert_close(m.task_actor(a, j, k + 1), trained[j], rtol=0, atol=1e-6)
    assert torch.equal(m.task_actor(a, 5, 4), m.task_actor(a, 3, 4))  # future tasks: the latest policy
    # task 3 pushed v3 as the 4th vector: one merge; exactly the tasks that use a merged vector moved
    slot = m.merge_history(a)
    merged = {i for i in range(4) if slot.count(slot[i]) > 1}
    assert len(merged) == 2
    uses = {0: set(), 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 1, 2, 3}}  # task j mixes the vectors before it, plus v_j
    for j in range(4):
        moved = not torch.allclose(m.task_actor(a, j, 4), trained[j], rtol=0, atol=1e-6)
        assert moved == bool(uses[j] & merged), j


def test_per_tensor_merging_may_pick_different_pairs_per_layer() -> None:
    m = CKARL(LAYOUT, 0, cfg=CKARLConfig(k_max=2, merge="tensor"))
    assert len(m.groups) == 6  # every weight and bias of the 3 layers
    D = m.actor_mlp.numel
    w0, w1 = m.groups[0], m.groups[2]
    v1, v2 = torch.zeros(D), torch.zeros(D)
    for vec, a_, b_ in ((v1, 1.0, 1.0), (v2, 1.0, -1.0)):
        vec[:] = torch.randn(D, generator=torch.Generator().manual_seed(4)) * 1e-3
        vec[w0] = a_
        vec[w1] = b_
    a = m.end_task(m.init_arrays(), 0)
    a = _push(m, a, 1, v1)
    a = _push(m, a, 2, v2)  # pool [0, v1, v2] > K_max = 2: each tensor merges its own most similar pair
    slots = a["slot_of"]
    assert slots[0, 1] == slots[0, 2]  # first weight: v1 and v2 are parallel there
    assert slots[2, 1] != slots[2, 2]  # second weight: v1 and v2 are opposite, v_null merges with one of them
    assert m.pool_size(a) == 2


def test_begin_task_initialises_v_beta_and_the_critic() -> None:
    paper = CKARL(LAYOUT, 7, cfg=CKARLConfig())
    code = CKARL(LAYOUT, 7, cfg=CKARLConfig(beta_init="randn_scaled"))
    a = paper.end_task(paper.init_arrays(), 0)
    a = _push(paper, a, 1, torch.ones(paper.actor_mlp.numel))
    a["v"] = torch.full_like(a["v"], 5.0)
    start, start_code = paper.begin_task(a, 2), code.begin_task(a, 2)
    assert not start["v"].any()
    n = paper.pool_size(a)
    draw = torch.randn(n, generator=torch.Generator().manual_seed(0))  # any draw; the two differ by 1/n only
    assert draw.shape == start["beta"][:n].shape
    torch.testing.assert_close(start_code["beta"][:n], start["beta"][:n] / n)
    assert not start["beta"][n:].any()
    assert not torch.equal(start["critic"], a["critic"]) and torch.equal(start["critic"], paper.fresh_critic(2))
    assert paper.trainable_keys(0) == ["base", "critic"]
    assert set(paper.trainable_keys(2)) == {"v", "beta", "critic"}


@pytest.mark.parametrize("cfg,match", [(CKARLConfig(k_max=1), "k_max"), (CKARLConfig(merge="layer"), "merge"),
                                       (CKARLConfig(encoder="cnn"), "encoder")])
def test_bad_options_are_config_errors(cfg: CKARLConfig, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CKARL(LAYOUT, 0, cfg=cfg)
