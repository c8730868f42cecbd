"""LCoTTA's gradient window and projector (clients/tta/subspace.py): FIFO order, centred PCA with
sklearn semantics, and an idempotent projection onto the top-r subspace."""

from __future__ import annotations

import pytest
import torch
from sklearn.decomposition import PCA

from clients.tta.subspace import GradientWindow, principal_subspace, project
from fedsim.errors import ConfigError


pytestmark = pytest.mark.usefixtures("one_thread")


def orthonormal(d: int, k: int, seed: int = 0) -> torch.Tensor:
    """k orthonormal rows in R^d."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return q.t()


def test_window_is_fifo_with_capacity():
    w = GradientWindow(capacity=3, dim=4)
    assert len(w) == 0 and w.matrix().shape == (0, 4)
    versions = []
    for i in range(7):
        w.append(torch.full((4,), float(i)))
        versions.append(w.version)
    assert len(w) == 3
    assert w.matrix()[:, 0].tolist() == [4.0, 5.0, 6.0]  # oldest first, oldest dropped
    assert versions == sorted(set(versions))  # every append changes the version


def test_window_stores_copies_and_round_trips():
    w = GradientWindow(capacity=5, dim=3)
    g = torch.ones(3)
    w.append(g)
    g.mul_(7)  # the caller's tensor changes later (as p.grad does)
    assert torch.equal(w.matrix(), torch.ones(1, 3))
    w2 = GradientWindow(capacity=5, dim=3)
    w2.load_matrix(w.matrix())
    assert torch.equal(w2.matrix(), w.matrix())


@pytest.mark.parametrize("bad", [torch.ones(5), torch.ones(2, 4)])
def test_window_rejects_wrong_shape(bad):
    with pytest.raises(ConfigError):
        GradientWindow(capacity=3, dim=4).append(bad)


def test_window_rejects_bad_capacity_and_oversized_load():
    with pytest.raises(ConfigError):
        GradientWindow(capacity=0, dim=4)
    with pytest.raises(ConfigError):
        GradientWindow(capacity=2, dim=4).load_matrix(torch.zeros(3, 4))


def test_principal_subspace_matches_sklearn_pca():
    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.1, 0.1, 0.1])
    w = torch.randn(40, 8, generator=g) * scales @ orthonormal(8, 8, seed=1).float() + torch.randn(8, generator=g)
    p, evr = principal_subspace(w, 3)
    pca = PCA(n_components=3, svd_solver="full").fit(w.numpy().astype("float64"))
    q = torch.tensor(pca.components_, dtype=torch.float32)
    assert torch.allclose(p.t() @ p, q.t() @ q, atol=1e-5)  # same subspace (signs may differ)
    assert torch.allclose(evr, torch.tensor(pca.explained_variance_ratio_, dtype=torch.float32), atol=1e-5)


def test_components_orthonormal_and_ratios_sorted():
    w = torch.randn(30, 12, generator=torch.Generator().manual_seed(0))
    p, evr = principal_subspace(w, 6)
    assert p.shape == (6, 12) and evr.shape == (6,)
    assert torch.allclose(p @ p.t(), torch.eye(6), atol=1e-5)
    assert torch.all(evr[:-1] >= evr[1:]) and torch.all(evr >= 0)
    assert float(evr.sum()) <= 1 + 1e-6
    full = principal_subspace(w, 12)[1]
    assert float(full.sum()) == pytest.approx(1.0, abs=1e-5)


def test_projection_onto_top_r_subspace():
    d = 10
    u = orthonormal(d, d, seed=2).float()
    coeff = torch.randn(50, 2, generator=torch.Generator().manual_seed(4)) * torch.tensor([3.0, 1.0])
    window = coeff @ u[:2] + 2.0 * u[5]  # rank-2 variation around an offset
    p, evr = principal_subspace(window, 2)
    for k in (0, 1):  # the subspace itself is untouched
        assert torch.allclose(project(u[k], p), u[k], atol=1e-5)
    for k in range(2, d):  # its orthogonal complement goes to zero
        assert project(u[k], p).norm() < 1e-5
    assert float(evr.sum()) == pytest.approx(1.0, abs=1e-5)


def test_pca_is_centred():
    """The constant offset shared by all snapshots is not a principal direction."""
    u = orthonormal(6, 2, seed=5).float()
    s = torch.linspace(-1, 1, 20).unsqueeze(1)
    window = 10.0 * u[0] + s * u[1]
    p, _ = principal_subspace(window, 1)
    assert project(u[0], p).norm() < 1e-5
    assert torch.allclose(project(u[1], p), u[1], atol=1e-5)


def test_projection_is_idempotent_and_orthogonal():
    gen = torch.Generator().manual_seed(6)
    p, _ = principal_subspace(torch.randn(20, 9, generator=gen), 4)
    g = torch.randn(9, generator=gen)
    once = project(g, p)
    assert torch.allclose(project(once, p), once, atol=1e-6)
    assert torch.allclose(p @ (g - once), torch.zeros(4), atol=1e-5)  # residual ⟂ subspace


def test_zero_variance_window_gives_zero_ratios():
    _, evr = principal_subspace(torch.ones(5, 4), 2)
    assert torch.equal(evr, torch.zeros(2))


@pytest.mark.parametrize("r", [0, 6, 9])
def test_rank_out_of_range(r):
    with pytest.raises(ConfigError):
        principal_subspace(torch.randn(5, 8), r)
