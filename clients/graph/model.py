"""ImGDA's dual-branch GCN encoder (the authors' ``Models.GNNEncoder``) with PyG layers.

Two :class:`~torch_geometric.nn.GCNConv` layers (``normalize=False``: the operator's weights come
normalised from :mod:`clients.graph.ppmi`), ``in -> dim -> dim``, ReLU and dropout after the first.
The *same* weights run on either operator: the local branch (normalised adjacency) or the global
branch (normalised PPMI); the branch is chosen by the operator passed in.  On the source graph the
authors add a learnable per-node compensation vector after each layer (:class:`Compensation`,
initialised ``N(-1, 1)`` as coded: mean -1, std 1); it belongs to one source graph, so it is
node-local state in the federated variant and never shared.

Deviation: the authors keep their dropout layers in a plain list, so ``model.eval()`` never turns
them off and their evaluation is stochastic; here dropout is an ``nn.Dropout`` module and is off in
evaluation.

:class:`GraphNet` bundles the shared parts of every method: the encoder, the linear classifier
(``dim -> C``), and, for the adversarial baselines, UDAGCN's domain discriminator
(``dim -> 40 -> 2`` with ReLU and dropout, behind a gradient-reversal layer) and its attention over
the two branches (``Linear(dim, 1)`` scores, softmax over branches).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch_geometric.nn import GCNConv

from clients.graph.ppmi import Operator, SparseOperator

__all__ = ["BranchAttention", "Compensation", "DualGCN", "GraphNet"]


class DualGCN(nn.Module):
    """Two GCN layers shared by the local and the global branch."""

    def __init__(self, in_dim: int, dim: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.convs = nn.ModuleList([GCNConv(in_dim, dim, normalize=False, add_self_loops=False),
                                    GCNConv(dim, dim, normalize=False, add_self_loops=False)])
        self.dropout = nn.Dropout(dropout)

    @staticmethod
    def conv(conv: GCNConv, x: torch.Tensor, op: Operator | SparseOperator) -> torch.Tensor:
        """One GCN layer: ``conv(x, edge_index, edge_weight)`` for an operator pair; for a
        :class:`SparseOperator` the same layer (``conv.lin``, propagation, ``conv.bias``) with the
        cached-transpose sparse product (GCNConv's own sparse path re-transposes in every backward)."""
        if isinstance(op, tuple):
            return conv(x, *op)
        out = op @ conv.lin(x)
        return out + conv.bias if conv.bias is not None else out

    def forward(self, x: torch.Tensor, op: Operator | SparseOperator, compensation: Sequence[torch.Tensor] | None = None
                ) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = self.conv(conv, x, op)
            if compensation is not None:
                x = x + compensation[i]
            if i < len(self.convs) - 1:
                x = self.dropout(torch.relu(x))
        return x


class Compensation(nn.Module):
    """Per-node source compensation vectors, one ``(num_nodes, dim)`` matrix per layer, init ``N(-1, 1)``."""

    def __init__(self, num_nodes: int, dim: int, layers: int = 2, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.vectors = nn.ParameterList([nn.Parameter(torch.randn(num_nodes, dim, generator=generator) - 1.0)
                                         for _ in range(layers)])

    def forward(self) -> list[torch.Tensor]:
        return list(self.vectors)


class BranchAttention(nn.Module):
    """UDAGCN's attention: a softmax over branches of ``Linear(dim, 1)`` scores, then the weighted sum."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, branches: Sequence[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack(list(branches), dim=1)  # [N, B, dim]
        weights = torch.softmax(self.score(stacked), dim=1)
        return (stacked * weights).sum(dim=1)


class GraphNet(nn.Module):
    """The parts a method shares with the server: encoder, classifier and optional adversarial parts."""

    def __init__(self, in_dim: int, dim: int, num_classes: int, dropout: float = 0.1, discriminator: bool = False,
                 attention: bool = False) -> None:
        super().__init__()
        self.encoder = DualGCN(in_dim, dim, dropout)
        self.classifier = nn.Linear(dim, num_classes)
        self.discriminator = nn.Sequential(nn.Linear(dim, 40), nn.ReLU(), nn.Dropout(dropout), nn.Linear(40, 2)) \
            if discriminator else None
        self.attention = BranchAttention(dim) if attention else None
