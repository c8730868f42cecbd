"""The two propagation operators against direct dense computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clients.graph.model import DualGCN
from clients.graph.ppmi import (
    WalkCounts,
    gcn_operator,
    ppmi_from_counts,
    ppmi_operator,
    sparse_operator,
    walk_counts,
)

# a 5-node graph: a triangle 0-1-2 with a tail 2-3-4 (given one direction per edge, as edgelists are)
EDGES = torch.tensor([[0, 1, 2, 2, 3], [1, 2, 0, 3, 4]])
N = 5


def dense(op: tuple[torch.Tensor, torch.Tensor], n: int) -> np.ndarray:
    m = np.zeros((n, n))
    np.add.at(m, (op[0][0].numpy(), op[0][1].numpy()), op[1].double().numpy())
    return m


def sym_normalise(w: np.ndarray) -> np.ndarray:
    w = w.copy()
    np.fill_diagonal(w, np.where(np.diag(w) == 0, 1.0, np.diag(w)))  # remaining self-loops of weight 1
    d = w.sum(1)
    inv = np.where(d > 0, d ** -0.5, 0.0)
    return inv[:, None] * w * inv[None, :]


def direct_ppmi(counts: np.ndarray, path_len: int) -> np.ndarray:
    """The authors' formula written densely: log(p(b|a) / sum_a' p(b|a') * n_visited / path_len) on visited pairs."""
    p = counts / counts.sum(1, keepdims=True).clip(min=1e-300)
    visited = counts > 0
    n_visited = int(visited.any(0).sum())
    col = p.sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        pmi = np.log(p / col[None, :] * n_visited / path_len)
    return np.where(visited, pmi, 0.0)


def test_gcn_operator_is_the_symmetric_normalised_adjacency_with_self_loops() -> None:
    a = np.zeros((N, N))
    a[EDGES[0], EDGES[1]] = 1
    a = a + a.T
    op = gcn_operator(torch.cat([EDGES, EDGES.flip(0)], 1), N)
    assert dense(op, N) == pytest.approx(sym_normalise(a), abs=1e-6)


def test_ppmi_equals_the_dense_formula_on_the_walk_counts() -> None:
    counts = walk_counts(EDGES, N, walks=30, path_len=4, seed=1)
    index, weight = ppmi_from_counts(counts, path_len=4)
    expected = direct_ppmi(counts.dense(), 4)
    got = np.zeros((N, N))
    got[index[0].numpy(), index[1].numpy()] = weight.numpy()
    assert got == pytest.approx(expected, abs=1e-12)
    assert (weight < 0).any()  # the authors' "PPMI" keeps negative PMI values ...
    clipped_index, clipped = ppmi_from_counts(counts, path_len=4, positive=True)
    assert torch.equal(clipped, weight[weight > 0]) and torch.equal(clipped_index, index[:, weight > 0])  # ... or not
    # the operator: those weights, remaining self-loops of weight 1, symmetric normalisation by row sums
    op = ppmi_operator(EDGES, N, walks=30, path_len=4, seed=1, positive=True)
    assert dense(op, N) == pytest.approx(sym_normalise(np.maximum(expected, 0)), abs=1e-6)


def test_walk_counts_converge_to_the_expected_visits() -> None:
    """E[visits of b from a] / walks = (1/L) sum_{l=1..L} sum_{k=1..l} (P^k)[a, b], P the random-walk matrix."""
    a = np.zeros((N, N))
    a[EDGES[0], EDGES[1]] = 1
    a = a + a.T
    p = a / a.sum(1, keepdims=True)
    L, walks = 3, 6000
    powers = [np.linalg.matrix_power(p, k) for k in range(1, L + 1)]
    expected = sum(sum(powers[:length]) for length in range(1, L + 1)) / L
    counts = walk_counts(EDGES, N, walks=walks, path_len=L, seed=0).dense() / walks
    assert counts == pytest.approx(expected, abs=0.03)
    # seeded: same seed, same counts; another seed, other counts
    c1, c2 = walk_counts(EDGES, N, 5, L, seed=3), walk_counts(EDGES, N, 5, L, seed=3)
    assert np.array_equal(c1.dense(), c2.dense())
    assert not np.array_equal(c1.dense(), walk_counts(EDGES, N, 5, L, seed=4).dense())


def test_isolated_nodes_start_no_walk() -> None:
    counts = walk_counts(EDGES, N + 1, walks=4, path_len=2, seed=0)
    assert isinstance(counts, WalkCounts) and 5 not in counts.start.tolist() and 5 not in counts.end.tolist()
    op = ppmi_operator(EDGES, N + 1, walks=4, path_len=2, seed=0)
    assert dense(op, N + 1)[5].tolist() == [0, 0, 0, 0, 0, 1.0]  # only its self-loop


def test_sparse_operator_layer_equals_gcnconv_message_passing_with_the_same_gradients() -> None:
    torch.manual_seed(0)
    op = ppmi_operator(EDGES, N, walks=10, path_len=3, seed=2)
    net = DualGCN(3, 4, dropout=0.0)
    x = torch.randn(N, 3)
    out_mp = net(x, op)  # PyG GCNConv(x, edge_index, edge_weight) message passing
    grads_mp = torch.autograd.grad(out_mp.pow(2).sum(), list(net.parameters()))
    out_sp = net(x, sparse_operator(op, N))
    grads_sp = torch.autograd.grad(out_sp.pow(2).sum(), list(net.parameters()))
    assert torch.allclose(out_mp, out_sp, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads_mp, grads_sp))
    # and GCNConv's propagation is sum_j w(j -> i) x_j, i.e. the dense operator transposed
    w = torch.tensor(dense(op, N), dtype=torch.float32)
    lin = net.convs[0].lin(x)
    assert torch.allclose(sparse_operator(op, N) @ lin, w.t() @ lin, atol=1e-6)
