"""Graph domains of the ImGDA regime: the CSBM source/target, the long-tail construction, the citation loader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch_geometric.utils import homophily

from envs.graphs import (
    CSBMParams,
    class_counts,
    csbm_domains,
    long_tail_sizes,
    long_tailed,
    load_citation,
    partition_nodes,
)
from fedsim.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = CSBMParams(num_classes=4, num_features=8, source_nodes_per_class=100, target_nodes_per_class=50)


def test_long_tail_sizes_follow_the_geometric_profile() -> None:
    # n_max * rho^(-i / (C - 1)), floored: 320 / 20 = 16 exactly at the tail (no float loss)
    assert long_tail_sizes([320, 300, 310, 305, 315], 20) == [320, 16, 71, 33, 151]
    assert long_tail_sizes([100, 100, 100], 4, order=[2, 0, 1]) == [50, 25, 100]
    assert long_tail_sizes([10, 10, 10], 5) == [10, 4, 2]  # the authors' int(n * mu**i) gives 1 for the tail
    assert long_tail_sizes([80, 90], 1) == [80, 90]  # rho = 1 keeps every class whole (capped at its count)
    with pytest.raises(ConfigError, match="imbalance factor"):
        long_tail_sizes([10, 10], 50)
    with pytest.raises(ConfigError, match="permutation"):
        long_tail_sizes([10, 10], 2, order=[0, 0])


@pytest.mark.parametrize("rho", [1.0, 5.0, 20.0])
def test_long_tailed_graph_has_exactly_the_requested_class_sizes(rho: float) -> None:
    src = csbm_domains(SMALL, 3).source
    counts = class_counts(src.y[src.train_mask], 4)
    lt = long_tailed(src, rho, order=[1, 3, 0, 2])
    assert lt.sizes == class_counts(lt.graph.y, 4) == long_tail_sizes(counts, rho, [1, 3, 0, 2])
    assert lt.sizes[1] == max(counts) or lt.sizes[1] == counts[1]  # the head class keeps its nodes
    assert bool(src.train_mask[lt.nodes].all())  # only training nodes are kept
    assert torch.equal(lt.graph.x, src.x[lt.nodes]) and torch.equal(lt.graph.y, src.y[lt.nodes])
    # the induced subgraph: every kept edge joins two kept nodes, and none is lost
    kept = torch.zeros(src.num_nodes, dtype=torch.bool)
    kept[lt.nodes] = True
    assert lt.graph.edge_index.shape[1] == int((kept[src.edge_index[0]] & kept[src.edge_index[1]]).sum())


def test_long_tail_removes_the_lowest_degree_training_nodes() -> None:
    """With one removal step, a class loses exactly its lowest-in-degree training nodes (ties by index)."""
    src = csbm_domains(SMALL, 4).source
    lt = long_tailed(src, 4.0, order=[0, 1, 2, 3], steps=1)
    deg = torch.bincount(src.edge_index[1], minlength=src.num_nodes)  # the head class (rank 0) removes nothing
    c1 = torch.nonzero((src.y == 1) & src.train_mask).view(-1)
    lowest = c1[torch.sort(deg[c1], stable=True).indices[: len(c1) - lt.sizes[1]]]
    kept = set(lt.nodes.tolist())
    assert lt.sizes[0] == int(((src.y == 0) & src.train_mask).sum())
    assert not kept & set(lowest.tolist()) and set(c1.tolist()) - set(lowest.tolist()) <= kept


def test_same_seed_same_graphs_and_the_target_is_shifted() -> None:
    a, b, c = csbm_domains(SMALL, 7), csbm_domains(SMALL, 7), csbm_domains(SMALL, 8)
    for g, h in ((a.source, b.source), (a.target, b.target)):
        assert torch.equal(g.x, h.x) and torch.equal(g.edge_index, h.edge_index) and torch.equal(g.y, h.y)
    assert torch.equal(a.source.train_mask, b.source.train_mask)
    assert not torch.equal(a.source.x, c.source.x)
    masks = a.source.train_mask.int() + a.source.val_mask.int() + a.source.test_mask.int()
    assert bool((masks == 1).all()) and int(a.source.train_mask.sum()) == 320
    # structure shift: the target's homophily follows its own p_in / p_out
    p = CSBMParams(num_classes=4, num_features=8, source_nodes_per_class=150, target_nodes_per_class=150,
                   source_p_in=0.05, source_p_out=0.002, target_p_in=0.02, target_p_out=0.01, feature_shift=3.0)
    d = csbm_domains(p, 0)
    assert homophily(d.source.edge_index, d.source.y) > 0.8 > 0.6 > homophily(d.target.edge_index, d.target.y)
    # feature shift: a common offset of norm feature_shift between the class-conditional means
    offsets = torch.stack([d.target.x[d.target.y == k].mean(0) - d.source.x[d.source.y == k].mean(0) for k in range(4)])
    assert offsets.mean(0).norm() == pytest.approx(3.0, abs=0.4)
    assert bool((offsets - offsets.mean(0)).norm(dim=1).max() < 0.6)
    no_shift = csbm_domains(CSBMParams(**{**vars(p), "feature_shift": 0.0}), 0)
    gap = no_shift.target.x.mean(0) - no_shift.source.x.mean(0)
    assert float(gap.norm()) < 0.5


def test_partition_nodes_is_a_seeded_disjoint_cover() -> None:
    parts = partition_nodes(103, 3, seed=5)
    assert sorted(torch.cat(parts).tolist()) == list(range(103))
    assert [len(p) for p in parts] == [35, 34, 34]
    assert all(torch.equal(p, q) for p, q in zip(parts, partition_nodes(103, 3, seed=5)))


def test_citation_loader_reads_the_authors_format(tmp_path) -> None:
    g = load_citation(FIXTURES, "tiny", seed=0)
    assert g.x.shape == (6, 4) and g.x[0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert g.y.tolist() == [0, 0, 0, 1, 1, 1]
    assert g.edge_index.tolist() == [[0, 1, 2, 3, 4, 2], [1, 2, 0, 4, 5, 3]]
    assert int(g.train_mask.sum()) == 4 and int(g.val_mask.sum()) == 0 and int(g.test_mask.sum()) == 2
    assert torch.equal(g.train_mask, load_citation(FIXTURES, "tiny", seed=0).train_mask)
    # UDAGCN-style names under raw/ work too
    raw = tmp_path / "raw"
    raw.mkdir()
    for what in ("docs", "edgelist", "labels"):
        (raw / f"tiny_{what}.txt").write_text((FIXTURES / f"tiny.{what}.txt").read_text())
    assert torch.equal(load_citation(tmp_path, "tiny").x, g.x)
    with pytest.raises(ConfigError, match="no other.docs.txt"):
        load_citation(FIXTURES, "other")
    (raw / "tiny_labels.txt").write_text("0\n1\n")
    with pytest.raises(ConfigError, match="6 feature rows but 2 labels"):
        load_citation(tmp_path, "tiny")


def test_bad_generator_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="graph.source_p_in"):
        csbm_domains(CSBMParams(source_p_in=1.5), 0)
    with pytest.raises(ConfigError, match="train_fraction"):
        csbm_domains(CSBMParams(train_fraction=0.95, val_fraction=0.1), 0)
    assert math.isclose(CSBMParams().train_fraction + CSBMParams().val_fraction, 0.9)
