"""ImGDA's losses: the vectorised forms equal per-class loops over the authors' formulas; aligned embeddings
minimise them; the class-dependent temperature; the baselines' gradient reversal and class weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from clients.graph.baselines import METHODS, dann_lambda, grad_reverse, udagcn_rate
from clients.graph.losses import (
    anchor_nodes,
    balanced_weights,
    class_prototypes,
    cross_branch_loss,
    cross_domain_loss,
    dynamic_temperature,
    pseudo_labels,
)
from clients.graph.model import Compensation

C, D = 3, 6


def labelled(n: int = 30, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % C
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g), y


def loop_cross_branch(zl, zg, y, al, ag, tau):
    """L_cb as the authors write it: a loop over (prototype branch, class, embedding branch)."""
    protos = [F.normalize(class_prototypes(zl, y, C), dim=1), F.normalize(class_prototypes(zg, y, C), dim=1)]
    embeds, anchors = [F.normalize(zl, dim=1), F.normalize(zg, dim=1)], [al.tolist(), ag.tolist()]
    total = 0.0
    for proto in protos:
        for c in range(C):
            for z, a in zip(embeds, anchors):
                nodes = [i for i in a if int(y[i]) == c]
                sims = torch.exp(z @ proto[c] / tau[c])
                total += -torch.log(sims[nodes] / sims.sum()).mean()
    return total / (4 * C)


def loop_cross_domain(zt, branches, temperature=1.0):
    """L_cd as the authors write it: per branch, pseudo-label, then a loop over pseudo-classes."""
    total = 0.0
    for za, ya in branches:
        sim = torch.exp(F.normalize(zt, dim=1) @ F.normalize(za, dim=1).t() / temperature)
        yt = ((sim / sim.sum(1, keepdim=True)) @ F.one_hot(ya, C).float()).argmax(1)
        for c in range(C):
            nodes = torch.nonzero(yt == c).view(-1)
            if len(nodes) == 0:
                continue
            s = torch.exp(F.normalize(zt[nodes], dim=1) @ F.normalize(za[ya == c], dim=1).t() / temperature)
            per_node = -torch.log(s / s.sum(1, keepdim=True)).mean(1)
            total += per_node.mean() / len(nodes)
    return total / len(branches)


def test_cross_branch_loss_equals_the_loop_form() -> None:
    zl, zg, y = labelled()
    al, ag = torch.tensor([0, 3, 1, 4, 2, 5, 8]), torch.tensor([6, 9, 7, 10, 11, 14])
    tau = dynamic_temperature(torch.tensor([30, 12, 3]), 0.5)
    assert float(cross_branch_loss(zl, zg, y, al, ag, tau, C)) == pytest.approx(float(loop_cross_branch(zl, zg, y, al, ag, tau)),
                                                                                rel=1e-5)


def test_cross_domain_loss_equals_the_loop_form() -> None:
    zl, zg, y = labelled()
    zt = torch.randn(20, D, generator=torch.Generator().manual_seed(5))
    branches = [(zl[:12], y[:12]), (zg[6:21], y[6:21])]
    assert float(cross_domain_loss(zt, branches, C)) == pytest.approx(float(loop_cross_domain(zt, branches)), rel=1e-5)


def test_prototype_losses_are_minimised_by_aligned_embeddings() -> None:
    """Class-aligned embeddings (each node on its class direction) beat random and swapped ones."""
    basis = torch.eye(D)[:C] * 5
    _, _, y = labelled()
    aligned = basis[y] + 0.01 * torch.randn(len(y), D, generator=torch.Generator().manual_seed(1))
    rand_l, rand_g, _ = labelled(seed=2)
    al = ag = torch.arange(len(y))
    tau = torch.full((C,), 0.5)
    aligned_cb = cross_branch_loss(aligned, aligned, y, al, ag, tau, C)
    assert aligned_cb < cross_branch_loss(rand_l, rand_g, y, al, ag, tau, C)
    swapped = basis[(y + 1) % C]  # the global branch puts every class on another class's direction
    prototypes = (class_prototypes(aligned, y, C), class_prototypes(swapped, y, C))
    assert aligned_cb < cross_branch_loss(aligned, swapped, y, al, ag, tau, C, prototypes=prototypes)
    # L_cd: target nodes aligned with their class's anchors reach the minimum log |anchors(c)| / n_c ...
    anchors = [(aligned, y), (aligned, y)]
    target = basis[torch.arange(12) % C]
    value = cross_domain_loss(target, anchors, C)
    minimum = sum(math.log(10) / 4 for _ in range(C))  # 10 anchors per class, 4 target nodes per class
    assert float(value) == pytest.approx(minimum, rel=1e-3)
    # ... and beat spread-out anchors that give the same pseudo-labels
    spread = basis[y] + 2.0 * torch.randn(len(y), D, generator=torch.Generator().manual_seed(4))
    assert torch.equal(pseudo_labels(target, spread, y, C), pseudo_labels(target, aligned, y, C))
    assert value < cross_domain_loss(target, [(spread, y), (spread, y)], C)
    # with the all-anchor softmax, aligned targets also beat random ones
    assert cross_domain_loss(target, anchors, C, denominator="all") < cross_domain_loss(
        torch.randn(12, D, generator=torch.Generator().manual_seed(3)), anchors, C, denominator="all")


def test_coded_cross_domain_loss_rewards_collapsed_pseudo_labels() -> None:
    """The quirk kept from the authors' code: each pseudo-class's mean is divided by its size once more,
    so putting every target node in one pseudo-class lowers L_cd below the aligned, balanced minimum."""
    basis = torch.eye(D)[:C] * 5
    y = torch.arange(30) % C
    anchors = [(basis[y], y), (basis[y], y)]
    balanced = cross_domain_loss(basis[torch.arange(12) % C], anchors, C)
    collapsed = cross_domain_loss(basis[torch.zeros(12, dtype=torch.long)], anchors, C)
    assert float(collapsed) == pytest.approx(math.log(10) / 12, rel=1e-4)
    assert collapsed < balanced


def test_pseudo_labels_vote_with_the_most_similar_anchors() -> None:
    basis = torch.eye(D)[:C]
    y_anchor = torch.tensor([0, 0, 1, 1, 2, 2])
    target = basis[torch.tensor([2, 0, 1])] + 0.05
    assert pseudo_labels(target, basis[y_anchor], y_anchor, C, temperature=0.1).tolist() == [2, 0, 1]


def test_dynamic_temperature_is_lower_for_tail_classes_as_coded() -> None:
    tau = dynamic_temperature(torch.tensor([320, 80, 16]), 0.5)
    assert tau.tolist() == pytest.approx([1.0, 0.5 + 0.5 * 80 / 320, 0.5 + 0.5 * 16 / 320])
    assert dynamic_temperature(torch.tensor([50, 50, 50]), 0.5).tolist() == [1.0, 1.0, 1.0]  # balanced counts: no effect
    # a lower temperature sharpens the tail class's contrast: the loss of a well-placed anchor drops
    zl, zg, y = labelled()
    al = ag = torch.arange(len(y))
    sharp = cross_branch_loss(zl, zg, y, al, ag, torch.tensor([1.0, 1.0, 0.2]), C)
    flat = cross_branch_loss(zl, zg, y, al, ag, torch.ones(C), C)
    assert not torch.isclose(sharp, flat)
    assert METHODS["imgda_fixed_tau"].dynamic_tau is False and METHODS["imgda"].dynamic_tau is True


def test_anchor_nodes_are_the_top_degree_nodes_of_each_class() -> None:
    y = torch.tensor([0, 0, 0, 1, 1])
    edge_index = torch.tensor([[2, 2, 2, 1, 4, 4], [0, 1, 3, 0, 3, 0]])  # out-degrees: 0:0, 1:1, 2:3, 3:0, 4:2
    assert anchor_nodes(edge_index, y, 2).tolist() == [2, 1, 4, 3]
    assert anchor_nodes(edge_index, y, 5).tolist() == [2, 1, 0, 4, 3]


def test_gradient_reversal_flips_and_scales_the_gradient() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3)
    (grad_reverse(x, 0.3) @ w).sum().backward()
    assert torch.allclose(x.grad, -0.3 * w.expand(4, 3))
    assert torch.equal(grad_reverse(x, 0.3), x)  # identity forward
    assert dann_lambda(0.0) == 0.0 and dann_lambda(1.0) == pytest.approx(0.99991, abs=1e-5)
    assert udagcn_rate(0, 200) == 0.005 and udagcn_rate(150, 200) == 0.05


def test_balanced_weights_and_compensation_init() -> None:
    w = balanced_weights(torch.tensor([0, 0, 0, 1]), 3)
    assert w.tolist() == pytest.approx([4 / 9, 4 / 3, 0.0])
    comp = Compensation(2000, 8, generator=torch.Generator().manual_seed(0))
    v = torch.cat([p.detach().view(-1) for p in comp()])
    assert float(v.mean()) == pytest.approx(-1.0, abs=0.02) and float(v.std()) == pytest.approx(1.0, abs=0.02)
