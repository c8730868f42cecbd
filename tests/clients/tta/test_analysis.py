"""LCoTTA analysis helpers (clients/tta/analysis.py): per-sample gradients (batch decomposition and
frozen statistics), ET/ED groups, coherence, out-of-subspace fraction, explained variance."""

from __future__ import annotations

import math

import pytest
import torch

from clients.tta import build_method
from clients.tta.analysis import (
    entropy_groups,
    explained_variance,
    freeze_batch_stats,
    group_report,
    mean_pairwise_cosine,
    out_of_subspace_fraction,
    per_sample_grads,
)
from clients.tta.methods import eta_loss
from clients.tta.norm import collect_norm_params
from clients.tta.subspace import principal_subspace
from fedsim.errors import ConfigError
from tests.clients.tta.test_methods import C, bn_net, ln_net, stream


pytestmark = pytest.mark.usefixtures("one_thread")


def configured(net):
    return build_method("tent", net, C).model


def test_coherence_of_identical_opposite_and_orthogonal_gradients():
    g = torch.tensor([1.0, 2.0, -3.0])
    assert mean_pairwise_cosine(g.repeat(4, 1)) == pytest.approx(1.0)
    assert mean_pairwise_cosine(torch.stack([g, -g])) == pytest.approx(-1.0)
    assert mean_pairwise_cosine(torch.eye(3)) == pytest.approx(0.0)
    assert math.isnan(mean_pairwise_cosine(g.unsqueeze(0)))


def test_out_of_subspace_fraction():
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)))
    u = q.t()
    p = u[:2]
    inside = torch.stack([u[0], 2 * u[1] - u[0]])
    assert torch.allclose(out_of_subspace_fraction(inside, p), torch.zeros(2), atol=1e-6)
    assert torch.allclose(out_of_subspace_fraction(u[2:], p), torch.ones(4), atol=1e-6)
    mixed = (3 * u[0] + 4 * u[4]).unsqueeze(0)  # norm 5, of which 4 outside
    assert float(out_of_subspace_fraction(mixed, p)[0]) == pytest.approx(0.8, abs=1e-6)
    assert math.isnan(float(out_of_subspace_fraction(torch.zeros(1, 6), p)[0]))


def test_explained_variance_is_the_window_pca():
    w = torch.randn(12, 7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(explained_variance(w, 3), principal_subspace(w, 3)[1])


def test_entropy_groups():
    logits = torch.tensor([[9.0, 0, 0], [0, 9.0, 0], [0.1, 0, 0], [0, 0, 9.0]])
    labels = torch.tensor([0, 0, 0, 2])
    truthful, deceptive = entropy_groups(logits, labels, e_margin=0.5)
    assert truthful.tolist() == [True, False, False, True]  # confident and right
    assert deceptive.tolist() == [False, True, False, False]  # confident and wrong; sample 2 is unreliable
    truthful, _ = entropy_groups(logits, labels, 0.5, keep=torch.tensor([False, True, True, True]))
    assert truthful.tolist() == [False, False, False, True]


@pytest.mark.parametrize("e_margin", [None, 1.2])
def test_batch_mode_decomposes_the_batch_gradient(e_margin):
    model = configured(bn_net())
    x = stream(1)[0]
    g, logits = per_sample_grads(model, x, e_margin=e_margin, mode="batch")
    params, _ = collect_norm_params(model)
    out = model(x)
    assert torch.allclose(out, logits, atol=1e-6)
    ent = -(out.softmax(1) * out.log_softmax(1)).sum(1)
    loss = ent.mean() if e_margin is None else eta_loss(ent, torch.arange(len(x)), e_margin)
    batch = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
    assert torch.allclose(g.mean(0), batch, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # the model was not touched


def test_frozen_mode_is_per_sample_with_batch_statistics():
    model = configured(bn_net())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = stream(1)[0]
    g, logits = per_sample_grads(model, x, e_margin=1.2, mode="frozen")
    with torch.no_grad():
        assert torch.allclose(logits, model(x), atol=1e-5)  # same outputs as the batch forward
    gb, _ = per_sample_grads(model, x, e_margin=1.2, mode="batch")
    assert g.shape == gb.shape and not torch.allclose(g, gb, atol=1e-4)  # BN couples samples
    frozen = freeze_batch_stats(model, x)
    assert torch.allclose(frozen(x[:3]), logits[:3], atol=1e-5)  # separable: any subset, same logits
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_modes_agree_without_batchnorm():
    model = configured(ln_net())
    x = stream(1)[0]
    a, _ = per_sample_grads(model, x, e_margin=1.2, mode="batch")
    b, _ = per_sample_grads(model, x, e_margin=1.2, mode="frozen")
    assert torch.allclose(a, b, atol=1e-5)


def test_group_report():
    model = configured(bn_net())
    x = stream(1)[0]
    labels = model(x).argmax(1).detach()
    labels[:4] = (labels[:4] + 1) % C  # four confident-but-wrong candidates
    d = sum(p.numel() for p in collect_norm_params(model)[0])
    rep = group_report(model, x, labels, e_margin=1.6, subspace=torch.eye(d))
    assert rep["n_truthful"] + rep["n_deceptive"] > 0
    for tag in ("truthful", "deceptive"):
        if rep[f"n_{tag}"] >= 1:
            assert rep[f"out_of_subspace_{tag}"] == pytest.approx(0.0, abs=1e-6)  # P spans everything
        if rep[f"n_{tag}"] >= 2:
            assert -1 <= rep[f"coherence_{tag}"] <= 1


def test_bad_mode_and_model():
    with pytest.raises(ConfigError):
        per_sample_grads(configured(bn_net()), stream(1)[0], mode="exact")
    with pytest.raises(ConfigError):
        per_sample_grads(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, C)), stream(1)[0])
