"""The two propagation operators of ImGDA's dual-branch encoder, as ``(edge_index, edge_weight)`` pairs
for PyG's :class:`~torch_geometric.nn.GCNConv` with ``normalize=False``.

* :func:`gcn_operator` -- the local branch: ``D^-1/2 (A + I) D^-1/2`` (the authors'
  ``CachedGCNConv.norm2``: remaining self-loops of weight 1, degree summed over the *row*, which
  PyG's :func:`~torch_geometric.nn.conv.gcn_conv.gcn_norm` does with ``flow="target_to_source"``).
* :func:`ppmi_operator` -- the global branch, as the authors' ``GNN/ppmi_conv.py`` builds it (the
  UDAGCN construction): the edges are made undirected and de-duplicated; from every node with a
  neighbour, ``walks`` = 40 random walks of a length drawn uniformly from ``1..path_len`` (5)
  count every node they visit; ``p(b|a)`` = visits of ``b`` from ``a`` / all visits from ``a``;
  ``PMI(a, b) = log(p(b|a) / sum_a' p(b|a') * n_visited / path_len)``, ``n_visited`` the number of
  distinct nodes ever visited; then remaining self-loops of weight 1 and the symmetric
  normalisation above.  The authors' code keeps negative PMI values (no ``max(0, .)``, despite
  the name); ``positive=True`` clips them (PPMI proper).  Unclipped, a node whose positive and
  negative weights nearly cancel gets a huge ``deg ** -0.5``: on graphs of a few hundred nodes
  (a federated client's long-tailed subgraph) the normalised operator then has weights above 100
  and negative row sums, and training diverges; a sum <= 0 would make ``deg ** -0.5`` NaN, which
  is set to 0 here.  The walks are
  vectorised (all start nodes step together) and seeded; they draw the same distribution as the
  authors' per-node Python loop, not the same numbers.

:func:`adj_t` turns an operator into the transposed sparse CSR matrix that ``GCNConv`` multiplies
with directly (PyG's sparse path: about 10x faster on CPU than gather/scatter message passing over
the PPMI operator's ~60 entries per node, same result); :func:`sparse_operator` keeps its transpose
too, so that the backward pass does not transpose the matrix again every epoch (another 2-3x).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.utils import coalesce, to_undirected

__all__ = ["Operator", "SparseOperator", "WalkCounts", "adj_t", "gcn_operator", "ppmi_from_counts", "ppmi_operator",
           "sparse_operator", "walk_counts"]

Operator = tuple[torch.Tensor, torch.Tensor]  # (edge_index [2, E], edge_weight [E]) for GCNConv(normalize=False)


@dataclass
class WalkCounts:
    """Visit counts of the random walks: ``count[i]`` visits of ``end[i]`` from walks started at ``start[i]``."""

    start: np.ndarray
    end: np.ndarray
    count: np.ndarray
    num_nodes: int

    def dense(self) -> np.ndarray:
        m = np.zeros((self.num_nodes, self.num_nodes))
        np.add.at(m, (self.start, self.end), self.count)
        return m


def _normalise(edge_index: torch.Tensor, weight: torch.Tensor | None, num_nodes: int) -> Operator:
    index, w = gcn_norm(edge_index, weight, num_nodes, add_self_loops=True, flow="target_to_source",
                        dtype=torch.float64 if weight is None else weight.dtype)
    return index, torch.nan_to_num(w, nan=0.0).float()


def gcn_operator(edge_index: torch.Tensor, num_nodes: int) -> Operator:
    """The local branch's normalised adjacency with self-loops."""
    return _normalise(edge_index, None, num_nodes)


def walk_counts(edge_index: torch.Tensor, num_nodes: int, walks: int = 40, path_len: int = 5, seed: int = 0) -> WalkCounts:
    """Visit counts of ``walks`` random walks (length uniform in ``1..path_len``) from every non-isolated node."""
    und = coalesce(to_undirected(edge_index, num_nodes=num_nodes), num_nodes=num_nodes)
    row, col = und[0].numpy(), und[1].numpy()
    deg = np.bincount(row, minlength=num_nodes)
    ptr = np.concatenate([[0], np.cumsum(deg)])
    starts = np.nonzero(deg)[0]
    rng = np.random.default_rng(seed)
    keys: list[np.ndarray] = []
    for _ in range(walks):
        length = rng.integers(1, path_len + 1, size=len(starts))
        cur = starts
        for step in range(path_len):
            nxt = col[ptr[cur] + (rng.random(len(cur)) * deg[cur]).astype(np.int64)]
            active = length > step
            keys.append(starts[active].astype(np.int64) * num_nodes + nxt[active])
            cur = nxt
    uniq, count = np.unique(np.concatenate(keys) if keys else np.empty(0, np.int64), return_counts=True)
    return WalkCounts(uniq // num_nodes, uniq % num_nodes, count.astype(np.float64), num_nodes)


def ppmi_from_counts(counts: WalkCounts, path_len: int = 5, positive: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' PMI weights of the visited pairs (unnormalised, float64, no self-loops added);
    ``positive`` clips them at 0 (PPMI proper) and drops the zeros, so that every node then gets its
    self-loop of weight 1."""
    n = counts.num_nodes
    totals = np.bincount(counts.start, weights=counts.count, minlength=n)
    prob = counts.count / totals[counts.start]
    prob_sums = np.bincount(counts.end, weights=prob, minlength=n)
    n_visited = int(np.count_nonzero(np.bincount(counts.end, minlength=n)))
    pmi = np.log(prob / prob_sums[counts.end] * n_visited / path_len)
    keep = pmi > 0 if positive else np.ones(len(pmi), dtype=bool)  # clipped: zero entries are dropped
    index = torch.from_numpy(np.stack([counts.start[keep], counts.end[keep]])).long()
    return index, torch.from_numpy(pmi[keep])


def ppmi_operator(edge_index: torch.Tensor, num_nodes: int, walks: int = 40, path_len: int = 5, seed: int = 0,
                  positive: bool = False) -> Operator:
    """The global branch's normalised PPMI operator (random walks seeded by ``seed``; ``positive``: clip PMI at 0)."""
    index, weight = ppmi_from_counts(walk_counts(edge_index, num_nodes, walks, path_len, seed), path_len, positive)
    return _normalise(index, weight, num_nodes)


def adj_t(op: Operator, num_nodes: int) -> torch.Tensor:
    """``op`` as the sparse CSR matrix ``A^T`` (row = receiving node) that ``GCNConv(x, adj_t)`` propagates with."""
    edge_index, weight = op
    coo = torch.sparse_coo_tensor(torch.stack([edge_index[1], edge_index[0]]), weight, (num_nodes, num_nodes),
                                  check_invariants=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return coo.coalesce().to_sparse_csr()


@dataclass(frozen=True)
class SparseOperator:
    """A propagation matrix ``a`` (CSR, row = receiving node) and its transpose ``a_t`` for the backward pass."""

    a: torch.Tensor
    a_t: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.a.shape[0])

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        return _SparseProduct.apply(self.a, self.a_t, x)


class _SparseProduct(torch.autograd.Function):
    """``a @ x`` with the gradient ``a_t @ grad`` (``a`` is constant)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, a_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.a_t = a_t
        return torch.sparse.mm(a, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:  # type: ignore[override]
        return None, None, torch.sparse.mm(ctx.a_t, grad)


def sparse_operator(op: Operator, num_nodes: int) -> SparseOperator:
    """``op`` as a :class:`SparseOperator` (the matrix GCNConv's propagation multiplies with, and its transpose)."""
    edge_index, weight = op
    return SparseOperator(adj_t(op, num_nodes), adj_t((edge_index.flip(0), weight), num_nodes))
