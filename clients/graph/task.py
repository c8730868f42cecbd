"""What each node of a graph-domain-adaptation run holds: its graph, both operators and the anchors.

:func:`build_task` turns the graph domains of :mod:`envs.graphs` into node views:

* centralised (one node): node 0 holds the long-tailed source graph *and* the target graph;
* federated (``N >= 2`` nodes): the source graph's nodes are split at random into ``N - 1`` parts;
  source node ``i`` holds the subgraph induced by its part, made long-tailed with its own class
  order (the head-to-tail ranking rotated by ``i`` when ``client_order="rotate"``, so each
  client has different head and tail classes), and node ``N - 1`` holds the unlabelled target.

The server-side evaluation view is the whole original source graph (its ``val_mask`` nodes select
the model, as the authors' loader splits them) and the target graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch_geometric.data import Data

from clients.graph.losses import anchor_nodes
from clients.graph.ppmi import Operator, SparseOperator, gcn_operator, ppmi_operator, sparse_operator
from envs.graphs import GraphDomains, class_counts, induced, long_tail_order, long_tailed, partition_nodes
from fedsim.errors import ConfigError
from fedsim.seeding import derive_seed

__all__ = ["GraphTask", "GraphView", "SourceView", "build_task"]


@dataclass
class GraphView:
    """Features, labels and both propagation operators of one graph."""

    x: torch.Tensor
    y: torch.Tensor
    local: SparseOperator
    glob: SparseOperator

    @property
    def num_nodes(self) -> int:
        return int(self.x.shape[0])


@dataclass
class SourceView(GraphView):
    """A labelled long-tailed source graph with its anchor sets."""

    anchors_local: torch.Tensor = torch.empty(0, dtype=torch.long)
    anchors_global: torch.Tensor = torch.empty(0, dtype=torch.long)
    sizes: tuple[int, ...] = ()  # nodes per class
    order: tuple[int, ...] = ()  # classes from head to tail


@dataclass
class GraphTask:
    """Every node's data of one run, and the server's evaluation graphs."""

    sources: list[SourceView]  # one per source node
    target: GraphView
    source_eval: GraphView  # the whole original source graph
    val_mask: torch.Tensor
    original_counts: tuple[int, ...]  # class counts of the whole original source graph
    num_classes: int

    def pooled_sizes(self) -> list[int]:
        return [sum(s.sizes[k] for s in self.sources) for k in range(self.num_classes)]


def operators(data: Data, walks: int, path_len: int, seed: int, positive: bool) -> tuple[Operator, Operator]:
    n = data.num_nodes
    return gcn_operator(data.edge_index, n), ppmi_operator(data.edge_index, n, walks, path_len, seed, positive)


def view(data: Data, walks: int, path_len: int, seed: int, positive: bool) -> GraphView:
    local, glob = operators(data, walks, path_len, seed, positive)
    return GraphView(data.x, data.y, sparse_operator(local, data.num_nodes), sparse_operator(glob, data.num_nodes))


def build_task(domains: GraphDomains, num_sources: int, ratio: float, anchors: int, walks: int, path_len: int,
               seed: int, client_order: str = "rotate", positive: bool = True) -> GraphTask:
    """Long-tailed source views (one per source node), the target view and the evaluation view."""
    src, c = domains.source, domains.num_classes
    parts = [torch.arange(src.num_nodes)] if num_sources == 1 else \
        partition_nodes(src.num_nodes, num_sources, derive_seed(seed, "gda-partition"))
    base = long_tail_order(class_counts(src.y[src.train_mask], c))
    sources = []
    for i, nodes in enumerate(parts):
        data = src if num_sources == 1 else induced(src, nodes)
        order = base[i % c:] + base[: i % c] if client_order == "rotate" else base
        if int(data.train_mask.sum()) == 0 or min(class_counts(data.y[data.train_mask], c)) == 0:
            raise ConfigError(f"source node {i} has no training node of some class; use fewer clients or a "
                              f"larger graph (client.params.graph.source_nodes_per_class)")
        lt = long_tailed(data, ratio, order)
        g, n = lt.graph, lt.graph.num_nodes
        local, glob = operators(g, walks, path_len, derive_seed(seed, "gda-ppmi-source", i), positive)
        sources.append(SourceView(g.x, g.y, sparse_operator(local, n), sparse_operator(glob, n),
                                  anchors_local=anchor_nodes(local[0], g.y, anchors),
                                  anchors_global=anchor_nodes(glob[0], g.y, anchors),
                                  sizes=tuple(lt.sizes), order=tuple(lt.order)))
    target = view(domains.target, walks, path_len, derive_seed(seed, "gda-ppmi-target"), positive)
    full = view(src, walks, path_len, derive_seed(seed, "gda-ppmi-source-eval"), positive)
    return GraphTask(sources, target, full, src.val_mask, tuple(class_counts(src.y, c)), c)
