"""Graph domains for class-imbalanced graph domain adaptation (ImGDA, NeurIPS 2025, OpenReview QSK8VqiijI).

Pure data code (PyG :class:`~torch_geometric.data.Data` objects, no learning):

* :func:`csbm_domains` -- a source and a target graph from a contextual stochastic block model
  (CSBM): ``C`` blocks, edges from :func:`torch_geometric.utils.stochastic_blockmodel_graph`
  (intra-class probability ``p_in``, inter-class ``p_out``), features built here as
  ``x = mu_y + N(0, I)`` with class means ``mu_c = class_sep * u_c`` (``u_c`` random unit vectors).
  PyG's ``StochasticBlockModelDataset`` is not used: it draws features with scikit-learn's
  ``make_classification``, which crashes with current scikit-learn.  The source is balanced (it is
  made long-tailed afterwards, as the authors do); the target is balanced and shifted in structure
  (its own ``p_in`` / ``p_out``) and in features (a covariate shift: every target feature vector
  moves by ``feature_shift * o``, ``o`` a random unit vector).
  Each graph carries a random 80/10/10 ``train_mask`` / ``val_mask`` / ``test_mask`` split, as the
  authors' loader does.
* :func:`long_tail_sizes` / :func:`long_tailed` -- the authors' long-tail construction
  (``utils.make_longtailed_data_remove``, after GraphENS): on the training split, class sizes
  ``n_c = n_max * rho^(-rank_c / (C - 1))`` (floored, capped at the class's own count) with classes
  ranked head to tail, removing each class's lowest-degree training nodes in 10 steps (1 for the
  head class) so that degrees are recomputed as nodes go; the long-tailed source is the subgraph
  induced by the remaining training nodes.  Deviations: sizes are computed as
  ``n_max * rho ** (-i / (C - 1))`` with a 1e-9 tolerance before flooring (the authors'
  ``int(n_max * mu**i)`` can floor 16.0 to 15), and ties in degree are broken by node index
  (``torch.topk`` leaves them unspecified); the rank order may be given (federated clients use
  their own), by default classes are ranked by training count, ties by class index.
* :func:`load_citation` -- the authors' citation-network loader (``LoadDataset``; the UDAGCN
  format): ``{name}.docs.txt`` (one node per line, comma- or space-separated feature values),
  ``{name}.edgelist.txt`` (``a,b`` per line) and ``{name}.labels.txt`` (one integer per line), in
  ``root`` or ``root/raw``; ``{name}_docs.txt`` style names are accepted too.  The 80/10/10 split
  is seeded here (the authors draw it from NumPy's global generator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from fedsim.errors import ConfigError

if TYPE_CHECKING:  # torch-geometric is imported where it is used: importing this module stays cheap
    from torch_geometric.data import Data

__all__ = [
    "CSBMParams",
    "GraphDomains",
    "LongTail",
    "citation_domains",
    "class_counts",
    "csbm_domains",
    "csbm_graph",
    "induced",
    "load_citation",
    "long_tail_order",
    "long_tail_sizes",
    "long_tailed",
    "partition_nodes",
    "split_masks",
]


@dataclass
class CSBMParams:
    """Settings of the CSBM source and target graphs."""

    num_classes: int = 5
    num_features: int = 32
    class_sep: float = 1.0  # norm of each class mean; features are mean + N(0, I)
    source_nodes_per_class: int = 400  # before the long tail (80% of them form the training split)
    source_p_in: float = 0.02
    source_p_out: float = 0.001
    target_nodes_per_class: int = 300
    target_p_in: float = 0.016  # structure shift: the target's own edge probabilities
    target_p_out: float = 0.002
    feature_shift: float = 0.5  # norm of the common offset of the target features (0 = no feature shift)
    train_fraction: float = 0.8
    val_fraction: float = 0.1

    def check(self) -> None:
        """One-line ConfigErrors for impossible settings."""
        if self.num_classes < 2:
            raise ConfigError(f"graph.num_classes must be >= 2, got {self.num_classes}")
        if self.num_features < 1:
            raise ConfigError(f"graph.num_features must be >= 1, got {self.num_features}")
        if self.source_nodes_per_class < 10 or self.target_nodes_per_class < 2:
            raise ConfigError("graph.source_nodes_per_class must be >= 10 and graph.target_nodes_per_class >= 2")
        for name in ("source_p_in", "source_p_out", "target_p_in", "target_p_out"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"graph.{name} must be a probability in [0, 1], got {v}")
        if self.class_sep < 0 or self.feature_shift < 0:
            raise ConfigError("graph.class_sep and graph.feature_shift must be >= 0")
        if not (0 < self.train_fraction < 1 and 0 < self.val_fraction < 1 and self.train_fraction + self.val_fraction < 1):
            raise ConfigError("graph.train_fraction and graph.val_fraction must be in (0, 1) and sum to less than 1")


@dataclass
class GraphDomains:
    """A labelled source graph and a target graph (its labels are for evaluation only)."""

    source: Data  # x, y, edge_index, train_mask, val_mask, test_mask
    target: Data  # x, y, edge_index
    name: str

    @property
    def num_classes(self) -> int:
        return int(max(int(self.source.y.max()), int(self.target.y.max())) + 1)


@dataclass
class LongTail:
    """The long-tailed training subgraph of a graph."""

    graph: Data  # x, y, edge_index of the kept training nodes (relabelled 0..n-1)
    nodes: torch.Tensor  # their ids in the original graph
    sizes: list[int]  # kept nodes per class (by class id)
    order: list[int]  # class ids from head to tail


def _unit_rows(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((rows, dim))
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def split_masks(n: int, train_fraction: float, val_fraction: float, rng: np.random.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random train / val / test node split (the authors' 80/10/10 protocol)."""
    perm = rng.permutation(n)
    n_train, n_val = int(n * train_fraction), int(n * val_fraction)
    masks = []
    for idx in (perm[:n_train], perm[n_train:n_train + n_val], perm[n_train + n_val:]):
        m = torch.zeros(n, dtype=torch.bool)
        m[torch.from_numpy(idx)] = True
        masks.append(m)
    return masks[0], masks[1], masks[2]


def csbm_graph(block_sizes: Sequence[int], p_in: float, p_out: float, means: np.ndarray, seed: int,
               noise: float = 1.0) -> Data:
    """One CSBM graph: undirected SBM edges (PyG) and Gaussian features around the class means."""
    from torch_geometric.data import Data
    from torch_geometric.utils import stochastic_blockmodel_graph

    c = len(block_sizes)
    probs = torch.full((c, c), float(p_out))
    probs.fill_diagonal_(float(p_in))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed % 2**63)
        edge_index = stochastic_blockmodel_graph(list(block_sizes), probs, directed=False)
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(c), block_sizes)
    x = means[y] + noise * rng.standard_normal((len(y), means.shape[1]))
    return Data(x=torch.from_numpy(x).float(), y=torch.from_numpy(y).long(), edge_index=edge_index)


def csbm_domains(p: CSBMParams, seed: int) -> GraphDomains:
    """The CSBM source (balanced, split 80/10/10) and the shifted, balanced target of ``seed``."""
    p.check()
    rng = np.random.default_rng([seed, 0])
    c, f = p.num_classes, p.num_features
    means = p.class_sep * _unit_rows(rng, c, f)
    shift = p.feature_shift * _unit_rows(rng, 1, f)
    source = csbm_graph([p.source_nodes_per_class] * c, p.source_p_in, p.source_p_out, means,
                        int(rng.integers(2**62)))
    target = csbm_graph([p.target_nodes_per_class] * c, p.target_p_in, p.target_p_out, means + shift,
                        int(rng.integers(2**62)))
    source.train_mask, source.val_mask, source.test_mask = split_masks(source.num_nodes, p.train_fraction,
                                                                       p.val_fraction, rng)
    return GraphDomains(source, target, "csbm")


def class_counts(y: torch.Tensor, num_classes: int) -> list[int]:
    return [int(v) for v in torch.bincount(y, minlength=num_classes)[:num_classes]]


def long_tail_order(counts: Sequence[int]) -> list[int]:
    """Classes from head to tail: by count, largest first, ties by class id."""
    return sorted(range(len(counts)), key=lambda k: (-counts[k], k))


def long_tail_sizes(counts: Sequence[int], ratio: float, order: Sequence[int] | None = None) -> list[int]:
    """Class sizes (by class id) of the authors' long tail: rank ``i`` keeps
    ``min(n_max * ratio^(-i / (C - 1)), n_c)`` nodes, ``n_max`` the largest count."""
    c = len(counts)
    order = list(order) if order is not None else long_tail_order(counts)
    if sorted(order) != list(range(c)):
        raise ConfigError(f"a long-tail order must be a permutation of the {c} classes, got {order}")
    if ratio < 1:
        raise ConfigError(f"the imbalance factor must be >= 1, got {ratio}")
    n_max = max(counts)
    sizes = [0] * c
    for rank, k in enumerate(order):
        n = int(math.floor(n_max * ratio ** (-rank / (c - 1)) + 1e-9))
        if n < 1:
            raise ConfigError(f"imbalance factor {ratio} leaves class {k} with no node ({n_max} nodes in the "
                              f"largest class); lower it or use a larger graph")
        sizes[k] = min(n, int(counts[k]))
    return sizes


def long_tailed(data: Data, ratio: float, order: Sequence[int] | None = None, mask: torch.Tensor | None = None,
                steps: int = 10) -> LongTail:
    """The authors' long-tailed subgraph of ``data``'s training nodes (``mask``, default ``train_mask``)."""
    from torch_geometric.utils import scatter

    y, n = data.y, data.num_nodes
    mask = (data.train_mask if mask is None else mask).clone()
    num_classes = int(y.max()) + 1
    counts = class_counts(y[mask], num_classes)
    order = list(order) if order is not None else long_tail_order(counts)
    sizes = long_tail_sizes(counts, ratio, order)
    row, col = data.edge_index
    cls_nodes = [torch.nonzero((y == k) & mask).view(-1) for k in range(num_classes)]
    removed: list[torch.Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(num_classes)]
    for rank, k in enumerate(order):
        to_remove = counts[k] - sizes[k]
        rounds = 1 if rank == 0 else steps
        for r in range(1, rounds + 1):
            alive = torch.ones(n, dtype=torch.bool)
            alive[torch.cat(removed)] = False
            keep = alive[row] & alive[col]
            degree = scatter(torch.ones(int(keep.sum())), col[keep], dim=0, dim_size=n, reduce="sum")
            order_k = torch.sort(degree[cls_nodes[k]], stable=True).indices
            removed[k] = cls_nodes[k][order_k[: (r * to_remove) // rounds]]
    alive = torch.ones(n, dtype=torch.bool)
    alive[torch.cat(removed)] = False
    kept = torch.nonzero(alive & mask).view(-1)
    graph = induced(data, kept)
    return LongTail(graph, kept, class_counts(graph.y, num_classes), order)


def induced(data: Data, nodes: torch.Tensor) -> Data:
    """The subgraph induced by ``nodes`` (relabelled in their order), with x and y."""
    from torch_geometric.data import Data
    from torch_geometric.utils import subgraph

    nodes = torch.sort(nodes).values
    edge_index, _ = subgraph(nodes, data.edge_index, relabel_nodes=True, num_nodes=data.num_nodes)
    out = Data(x=data.x[nodes], y=data.y[nodes], edge_index=edge_index)
    for key in ("train_mask", "val_mask", "test_mask"):
        if key in data:
            out[key] = data[key][nodes]
    return out


def partition_nodes(num_nodes: int, parts: int, seed: int) -> list[torch.Tensor]:
    """A seeded random split of the nodes into ``parts`` disjoint sets (federated source clients)."""
    perm = np.random.default_rng(seed).permutation(num_nodes)
    return [torch.from_numpy(np.sort(p)).long() for p in np.array_split(perm, parts)]


# -- the authors' citation-network format -------------------------------------------------------------
def _find(root: Path, name: str, what: str) -> Path:
    for folder in (root, root / "raw"):
        for sep in (".", "_"):
            path = folder / f"{name}{sep}{what}.txt"
            if path.is_file():
                return path
    raise ConfigError(f"citation data: no {name}.{what}.txt (or {name}_{what}.txt) in {root} or {root / 'raw'}")


def load_citation(root: str | Path, name: str, seed: int = 0, train_fraction: float = 0.8,
                  val_fraction: float = 0.1) -> Data:
    """One graph of the authors' citation format (``{name}.docs/edgelist/labels.txt``), split 80/10/10."""
    from torch_geometric.data import Data

    root = Path(root).expanduser()
    try:
        rows = [line.replace(",", " ").split() for line in _find(root, name, "docs").read_text().splitlines()
                if line.strip()]
        x = torch.tensor(np.asarray(rows, dtype=np.float32))
        edges = [line.replace(",", " ").split() for line in _find(root, name, "edgelist").read_text().splitlines()
                 if line.strip()]
        edge_index = torch.tensor(np.asarray(edges, dtype=np.int64).reshape(-1, 2).T.copy())
        y = torch.tensor([int(v) for v in _find(root, name, "labels").read_text().split()], dtype=torch.long)
    except ValueError as exc:
        raise ConfigError(f"citation data {name!r} in {root}: cannot parse ({exc})") from None
    if x.shape[0] != y.shape[0]:
        raise ConfigError(f"citation data {name!r}: {x.shape[0]} feature rows but {y.shape[0]} labels")
    if edge_index.numel() and int(edge_index.max()) >= y.shape[0]:
        raise ConfigError(f"citation data {name!r}: an edge names node {int(edge_index.max())}, but there are "
                          f"{y.shape[0]} nodes")
    data = Data(x=x, y=y, edge_index=edge_index)
    rng = np.random.default_rng([seed, 1])
    data.train_mask, data.val_mask, data.test_mask = split_masks(y.shape[0], train_fraction, val_fraction, rng)
    return data


def citation_domains(root: str | Path, source: str, target: str, seed: int = 0) -> GraphDomains:
    """Source and target graphs of the authors' citation benchmark (e.g. ACMv9 -> Citationv1)."""
    src, tgt = load_citation(root, source, seed), load_citation(root, target, seed)
    if src.x.shape[1] != tgt.x.shape[1]:
        raise ConfigError(f"citation data: {source} has {src.x.shape[1]} features but {target} has {tgt.x.shape[1]}")
    return GraphDomains(src, tgt, f"{source}->{target}")
