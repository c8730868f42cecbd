"""ImGDA, its ablations and the baselines as one table of method specs, plus the adversarial pieces.

Every method shares the encoder of :mod:`clients.graph.model`, the optimiser (Adam, the learner's
lr and weight decay) and the number of epochs, and differs only in what this table switches on:

========================  =========  ==================================================================
method                    inference  training objective
========================  =========  ==================================================================
``source``                local      CE on the source, adjacency GCN (source-only GCN)
``balanced``              local      class-balanced CE (weights ``N / (C n_c)``), adjacency GCN
``dann``                  local      CE + domain discriminator behind gradient reversal (DANN-GCN),
                                     ``lambda_p = 2 / (1 + exp(-10 p)) - 1`` (Ganin et al.), p = progress
``udagcn``                attention  UDAGCN-like: both branches (shared weights), attention fusion, CE,
                                     GRL discriminator with UDAGCN's rate ``min(epoch / epochs, 0.05)``,
                                     target entropy with weight ``0.01 * epoch / epochs``
``imgda``                 global     CE on the compensated global branch + ``L_cb`` + ``L_cd`` (the authors)
``imgda_no_cb``           global     ImGDA without the cross-branch prototype loss
``imgda_no_cd``           global     ImGDA without the cross-domain loss
``imgda_fixed_tau``       global     ImGDA with one temperature for every class (``fixed_tau``)
========================  =========  ==================================================================

UDAGCN deviations (its code: github.com/GRAND-Lab/UDAGCN): its weight-mean "regulariser"
(``param.mean() * 3e-3``) is dropped, its separate lr (3e-3) and dims (128 -> 16) are replaced by the
shared ones, and its PPMI walks use ImGDA's ``path_len`` (5, not 10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["METHODS", "MethodSpec", "GradReverse", "dann_lambda", "grad_reverse", "udagcn_rate"]


@dataclass(frozen=True)
class MethodSpec:
    """What one method trains and how it predicts."""

    summary: str
    branches: str = "local"  # local | dual: the operators the encoder runs on during training
    infer: str = "local"  # local | global | attention: the embedding the classifier sees at test time
    balanced_ce: bool = False
    compensation: bool = False  # ImGDA's per-node source compensation vectors
    cross_branch: bool = False  # L_cb
    cross_domain: bool = False  # L_cd
    dynamic_tau: bool = True  # class-dependent temperature in L_cb (else the learner's fixed_tau)
    adversary: str = ""  # "" | dann | udagcn: a GRL domain discriminator and its schedule
    entropy: bool = False  # UDAGCN's target entropy term
    attention: bool = False  # UDAGCN's attention over the two branches

    @property
    def uses_target(self) -> bool:
        """Whether the method trains on the (unlabelled) target graph at all."""
        return self.cross_domain or bool(self.adversary) or self.entropy

    @property
    def prototypes(self) -> bool:
        """Whether the federated variant shares class prototypes for this method."""
        return self.cross_branch or self.cross_domain


_IMGDA = dict(branches="dual", infer="global", compensation=True, cross_branch=True, cross_domain=True)

METHODS: dict[str, MethodSpec] = {
    "source": MethodSpec("source-only GCN"),
    "balanced": MethodSpec("class-balanced GCN", balanced_ce=True),
    "dann": MethodSpec("DANN-GCN (gradient reversal)", adversary="dann"),
    "udagcn": MethodSpec("UDAGCN-like dual branch", branches="dual", infer="attention", adversary="udagcn",
                         entropy=True, attention=True),
    "imgda": MethodSpec("ImGDA", **_IMGDA),
    "imgda_no_cb": MethodSpec("ImGDA without the cross-branch loss", **{**_IMGDA, "cross_branch": False}),
    "imgda_no_cd": MethodSpec("ImGDA without the cross-domain loss", **{**_IMGDA, "cross_domain": False}),
    "imgda_fixed_tau": MethodSpec("ImGDA with a fixed temperature", **_IMGDA, dynamic_tau=False),
}


class GradReverse(torch.autograd.Function):
    """Identity forward; the gradient is multiplied by ``-coeff`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, coeff: float) -> torch.Tensor:  # type: ignore[override]
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.neg() * ctx.coeff, None


def grad_reverse(x: torch.Tensor, coeff: float) -> torch.Tensor:
    return GradReverse.apply(x, coeff)


def dann_lambda(progress: float) -> float:
    """Ganin & Lempitsky's schedule ``2 / (1 + exp(-10 p)) - 1``, ``p`` in [0, 1]."""
    return 2.0 / (1.0 + math.exp(-10.0 * progress)) - 1.0


def udagcn_rate(epoch: int, epochs: int) -> float:
    """UDAGCN's GRL rate ``min((epoch + 1) / epochs, 0.05)`` (``epoch`` counted from 0)."""
    return min((epoch + 1) / epochs, 0.05)
