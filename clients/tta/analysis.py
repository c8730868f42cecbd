"""Analysis helpers for LCoTTA's claims: per-sample gradient coherence and gradient low-rankness.

Reference: Duan et al., NeurIPS 2025 (https://openreview.net/forum?id=NFvAa2hNzH).  The paper
(per a secondary summary; the PDF was not available) splits confident samples into
*entropy-truthful* (ET: low entropy and correct) and *entropy-deceptive* (ED: low entropy but
wrong), reports that ET gradients are highly correlated while ED gradients are scattered (and lie
largely outside the tracked subspace), and that the top principal components of the gradient
window explain most of its variance.  These helpers measure exactly that, given labels; nothing
here changes a model or its ``.grad``.

Per-sample gradients with BatchNorm on batch statistics are not separable (every sample's output
depends on the whole batch), so two definitions are offered:

* ``mode="batch"`` (default): gᵢ = ∂ℓᵢ/∂θ of sample i's loss *through the batch forward*, i.e.
  including the path through the batch mean and variance, via ``torch.autograd.grad(...,
  is_grads_batched=True)``.  These add up exactly: the ETA batch gradient equals the mean of gᵢ
  over the kept samples, so this is the decomposition of the update the method actually takes.
* ``mode="frozen"``: the batch's BatchNorm statistics are computed once and then frozen as
  constants; gᵢ is the gradient of sample i alone through that frozen network, computed with
  ``torch.func`` (``functional_call`` + ``vmap`` + ``grad``).  Separable, but not a decomposition
  of the batch gradient.

For LayerNorm/GroupNorm-only models the two coincide.  ℓᵢ is the ETA-weighted entropy
Hᵢ·exp(E0 − Hᵢ) (weight detached) when ``e_margin`` is given, else the plain entropy Hᵢ.
"""

from __future__ import annotations

import copy
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm

from clients.tta.methods import softmax_entropy
from clients.tta.norm import collect_norm_params
from clients.tta.subspace import principal_subspace, project
from fedsim.errors import ConfigError

Mode = Literal["batch", "frozen"]


def sample_losses(logits: torch.Tensor, e_margin: float | None) -> torch.Tensor:
    """Per-sample loss: Hᵢ·exp(E0 − Hᵢ) (weight detached) if ``e_margin`` is set, else Hᵢ."""
    h = softmax_entropy(logits)
    if e_margin is None:
        return h
    return h * (1 / torch.exp(h.detach() - e_margin))


def per_sample_grads(
    model: nn.Module, x: torch.Tensor, *, e_margin: float | None = None, mode: Mode = "batch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample gradients (N × D, norm-affine order of :func:`collect_norm_params`) and logits (N × C).

    See the module docstring for ``mode``.  The model, its parameters and ``.grad`` are unchanged.
    """
    params, names = collect_norm_params(model)
    if not params:
        raise ConfigError("per_sample_grads: the model has no norm affine parameters")
    if mode == "batch":
        return _batch_grads(model, x, params, names, e_margin)
    if mode == "frozen":
        return _frozen_grads(model, x, params, names, e_margin)
    raise ConfigError(f"per_sample_grads mode must be 'batch' or 'frozen', got {mode!r}")


def _batch_grads(model, x, params, names, e_margin):
    theta = {n: p.detach().clone().requires_grad_(True) for n, p in zip(names, params)}
    with torch.enable_grad():
        logits = functional_call(model, theta, (x,))
        losses = sample_losses(logits, e_margin)
        n = losses.shape[0]
        eye = torch.eye(n, dtype=losses.dtype, device=losses.device)
        grads = torch.autograd.grad(
            losses, list(theta.values()), grad_outputs=eye, is_grads_batched=True, allow_unused=True
        )
    flat = [
        (g if g is not None else torch.zeros(n, *t.shape, dtype=t.dtype, device=t.device)).reshape(n, -1)
        for g, t in zip(grads, theta.values())
    ]
    return torch.cat(flat, dim=1).detach(), logits.detach()


def _frozen_grads(model, x, params, names, e_margin):
    frozen = freeze_batch_stats(model, x)
    theta = {n: p.detach().clone() for n, p in zip(names, params)}

    def loss_one(th: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return sample_losses(functional_call(frozen, th, (xi.unsqueeze(0),)), e_margin)[0]

    def logits_one(xi: torch.Tensor) -> torch.Tensor:
        return functional_call(frozen, theta, (xi.unsqueeze(0),))[0]

    with torch.enable_grad():
        g = vmap(grad(loss_one), in_dims=(None, 0))(theta, x)
    with torch.no_grad():
        logits = vmap(logits_one)(x)
    n = x.shape[0]
    return torch.cat([g[k].reshape(n, -1) for k in names], dim=1).detach(), logits


def freeze_batch_stats(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """A copy of ``model`` whose batch-statistics BatchNorm layers use ``x``'s statistics as constants.

    Layers already normalising with running statistics (eval mode, running stats kept) are left
    alone.  Per-sample outputs of the copy equal the batch outputs of ``model`` on ``x``.
    """
    frozen = copy.deepcopy(model)
    layers = [m for m in frozen.modules()
              if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)]
    stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(mod: nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
        z = inp[0]
        dims = [0] + list(range(2, z.ndim))
        stats[id(mod)] = (z.mean(dims).detach(), z.var(dims, unbiased=False).detach())

    handles = [m.register_forward_pre_hook(hook) for m in layers]
    with torch.no_grad():
        frozen(x)
    for h in handles:
        h.remove()
    for m in layers:
        mean, var = stats[id(m)]
        m.track_running_stats = True
        m.running_mean, m.running_var = mean, var
        m.eval()
    return frozen


def entropy_groups(
    logits: torch.Tensor, labels: torch.Tensor, e_margin: float, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks (entropy-truthful, entropy-deceptive) over the batch.

    Both groups pass the reliability filter H < E0 (and ``keep`` if given, e.g. the redundancy
    filter); truthful ones are predicted correctly, deceptive ones wrongly.
    """
    reliable = softmax_entropy(logits.detach()) < e_margin
    if keep is not None:
        reliable = reliable & keep.to(torch.bool)
    correct = logits.detach().argmax(1) == labels.to(logits.device)
    return reliable & correct, reliable & ~correct


def mean_pairwise_cosine(g: torch.Tensor) -> float:
    """Mean cosine similarity over all pairs i < j of the rows of ``g`` (NaN for fewer than 2 rows).

    A zero row has cosine 0 with every other row.
    """
    n = g.shape[0]
    if n < 2:
        return math.nan
    u = F.normalize(g.detach().to(torch.float64), dim=1)
    c = u @ u.t()
    return float((c.sum() - c.diagonal().sum()) / (n * (n - 1)))


def out_of_subspace_fraction(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per row of ``g`` (N × D): ‖g − PᵀPg‖ / ‖g‖, the fraction of its norm outside span(P) (NaN for g = 0)."""
    g64 = g.detach().to(torch.float64)
    p64 = p.detach().to(torch.float64)
    residual = g64 - project(g64.t(), p64).t()
    norm = g64.norm(dim=1)
    out = residual.norm(dim=1) / norm
    return torch.where(norm > 0, out, torch.full_like(out, math.nan)).to(g.dtype)


def explained_variance(window: torch.Tensor, r: int) -> torch.Tensor:
    """Explained-variance ratios (r,) of the top-r principal components of a gradient window (n × D)."""
    return principal_subspace(window, r)[1]


def group_report(
    model: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    e_margin: float,
    *,
    subspace: torch.Tensor | None = None,
    weighted: bool = True,
    mode: Mode = "batch",
) -> dict[str, float]:
    """ET/ED diagnostics of one batch: group sizes, coherence, mean gradient norm, out-of-subspace fraction."""
    g, logits = per_sample_grads(model, x, e_margin=e_margin if weighted else None, mode=mode)
    truthful, deceptive = entropy_groups(logits, labels, e_margin)
    report: dict[str, float] = {}
    for tag, mask in (("truthful", truthful), ("deceptive", deceptive)):
        rows = g[mask]
        report[f"n_{tag}"] = float(mask.sum())
        report[f"coherence_{tag}"] = mean_pairwise_cosine(rows)
        report[f"grad_norm_{tag}"] = float(rows.norm(dim=1).mean()) if rows.shape[0] else math.nan
        if subspace is not None:
            frac = out_of_subspace_fraction(rows, subspace) if rows.shape[0] else torch.tensor([math.nan])
            report[f"out_of_subspace_{tag}"] = float(torch.nanmean(frac))
    return report
