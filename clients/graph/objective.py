"""One node's training objective for one full-batch epoch, for every method of :mod:`clients.graph.baselines`.

A node computes the terms it has the data for: a node holding a labelled source graph computes the
supervised terms (CE, ``L_cb``, the source side of the domain loss); a node holding the target graph
computes the target terms (``L_cd``, the target side of the domain loss, the entropy).  The
centralised node holds both, so its objective is the authors' ``train()`` exactly:
``L = L_cb + L_cd + L_ce`` for ImGDA, with the source embeddings computed with compensation and
the target embedding ``z_t = z_t^L + z_t^G`` without.

On a federated target node ``L_cd`` uses the global class prototypes (one "anchor" per class and
branch, from the previous round) with the all-anchor softmax (see :mod:`clients.graph.losses`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from clients.graph.baselines import MethodSpec, dann_lambda, grad_reverse, udagcn_rate
from clients.graph.losses import balanced_weights, cross_branch_loss, cross_domain_loss
from clients.graph.model import GraphNet
from clients.graph.task import GraphView, SourceView

__all__ = ["LossKnobs", "embed", "node_losses"]

TERMS = ("ce", "cb", "cd", "domain", "entropy")


@dataclass(frozen=True)
class LossKnobs:
    """Loss weights and temperatures (the authors' are 1, 1, 1 and tau0 = 0.5, T = 1)."""

    w_cb: float = 1.0
    w_cd: float = 1.0
    w_domain: float = 1.0
    cd_temperature: float = 1.0
    cd_denominator: str = "class"


def _branches(spec: MethodSpec, net: GraphNet, g: GraphView, comp: Sequence[torch.Tensor] | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(local embedding, global embedding or None, the embedding the classifier sees)."""
    z_local = net.encoder(g.x, g.local, comp)
    if spec.branches == "local":
        return z_local, None, z_local
    z_global = net.encoder(g.x, g.glob, comp)
    if spec.attention:
        return z_local, z_global, net.attention([z_local, z_global])
    return z_local, z_global, z_global


def embed(spec: MethodSpec, net: GraphNet, g: GraphView) -> torch.Tensor:
    """The inference embedding of ``g`` (no compensation): the branch or fusion the method predicts with."""
    if spec.infer == "local":
        return net.encoder(g.x, g.local)
    if spec.infer == "global":
        return net.encoder(g.x, g.glob)
    return net.attention([net.encoder(g.x, g.local), net.encoder(g.x, g.glob)])


def _domain_loss(net: GraphNet, z: torch.Tensor, label: int, coeff: float) -> torch.Tensor:
    logits = net.discriminator(grad_reverse(z, coeff))
    return F.cross_entropy(logits, torch.full((z.shape[0],), label, dtype=torch.long))


def node_losses(spec: MethodSpec, net: GraphNet, knobs: LossKnobs, *, source: SourceView | None = None,
                compensation: Sequence[torch.Tensor] | None = None, tau: torch.Tensor | None = None,
                target: GraphView | None = None, prototypes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                shared_cb: bool = False, epoch: int = 0, epochs: int = 1) -> dict[str, torch.Tensor]:
    """The weighted loss terms (``ce``, ``cb``, ``cd``, ``domain``, ``entropy``; zero where absent).

    ``prototypes`` = (local ``[K, d]``, global ``[K, d]``, their classes ``[K]``) of the federation
    (previous round); they are the cross-domain anchors of a target-only node, and with ``shared_cb``
    they replace the class means in a source node's ``L_cb``.
    """
    zero = torch.zeros(())
    out = {k: zero for k in TERMS}
    coeff = dann_lambda(epoch / max(epochs, 1)) if spec.adversary == "dann" else udagcn_rate(epoch, epochs)
    c = net.classifier.out_features
    zs_local = zs_global = None
    if source is not None:
        comp = compensation if spec.compensation else None
        zs_local, zs_global, zs = _branches(spec, net, source, comp)
        weight = balanced_weights(source.y, c) if spec.balanced_ce else None
        out["ce"] = F.cross_entropy(net.classifier(zs), source.y, weight=weight)
        if spec.cross_branch:
            protos = None
            if shared_cb and prototypes is not None:
                protos = _dense_prototypes(prototypes, c, zs_global)
            out["cb"] = knobs.w_cb * cross_branch_loss(zs_local, zs_global, source.y, source.anchors_local,
                                                       source.anchors_global, tau, c, prototypes=protos)
        if spec.adversary:
            out["domain"] = knobs.w_domain * _domain_loss(net, zs, 0, coeff)
    if target is not None:
        zt_local, zt_global, zt = _branches(spec, net, target, None)
        if spec.cross_domain:
            z_sum = zt_local + zt_global
            if source is not None:
                anchors = [(zs_local[source.anchors_local], source.y[source.anchors_local]),
                           (zs_global[source.anchors_global], source.y[source.anchors_global])]
                denominator = knobs.cd_denominator
            elif prototypes is not None:
                anchors = [(prototypes[0], prototypes[2]), (prototypes[1], prototypes[2])]
                denominator = "all"
            else:
                anchors = []
            if anchors:
                out["cd"] = knobs.w_cd * cross_domain_loss(z_sum, anchors, c, knobs.cd_temperature, denominator)
        if spec.adversary:
            out["domain"] = out["domain"] + knobs.w_domain * _domain_loss(net, zt, 1, coeff)
        if spec.entropy:
            p = torch.softmax(net.classifier(zt), dim=1).clamp(1e-9, 1.0)
            out["entropy"] = (-(p * p.log()).sum(1)).mean() * (epoch / max(epochs, 1) * 0.01)
    return out


def _dense_prototypes(prototypes: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_classes: int,
                      like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared prototypes as ``[C, d]`` matrices (a class the federation has not seen keeps a zero row)."""
    local = like.new_zeros((num_classes, like.shape[1]))
    glob = like.new_zeros((num_classes, like.shape[1]))
    local[prototypes[2]] = prototypes[0]
    glob[prototypes[2]] = prototypes[1]
    return local, glob
