"""Opacus' DP-SGD round, draw for draw, for a cohort of clients trained together (vectorised DP).

:func:`privacy.dp_sgd.private_local_training` runs one client's round through Opacus: a
``DPDataLoader`` (Poisson sampling), ``BatchMemoryManager`` (physical batches) and a
``DPOptimizer`` (per-sample clipping, Gaussian noise, the mean over the expected batch size).  A
cohort trained in one batched computation (:mod:`clients.vectorised`) cannot call Opacus per
client without paying Opacus' per-client set-up, which is most of a tiny client's round.  This
module gives it the same round from the same seeds instead:

* :func:`poisson_masks` is the sequence of logical batches the client's loader yields, drawn from
  ``Generator().manual_seed(batch_seed)`` with Opacus' own calls in Opacus' order: per pass over
  the loader one ``int64`` seed draw (``DataLoader.__iter__``), then one ``rand(n) < q`` per batch
  (``UniformWithReplacementSampler``) for ``int(1/q)`` batches, passes repeated until the round
  has its ``steps`` logical steps (an empty batch is a step: noise only, as in Opacus);
* :func:`noise_draws` is the noise ``DPOptimizer.add_noise`` draws from
  ``Generator(device).manual_seed(noise_seed)`` on the model's device: per logical step, one ``normal(0, σC, p.shape)`` per
  trainable parameter in the optimiser's order (no draw at σ = 0);
* :func:`privatise` is ``clip_and_accumulate`` + ``add_noise`` + ``scale_grad`` over a batch of
  clients: each example's gradient scaled to L2 norm ≤ C (factor ``min(1, C / (‖g‖ + 1e-6))`` over
  all parameters), summed over the client's real examples, noised, divided by the expected batch
  size ``int(n · q)``.

So the vectorised round is the sequential one up to float rounding (tested against Opacus in
``tests/privacy/test_cohort.py``).  Splitting a logical batch into physical batches changes
nothing here: Opacus accumulates the clipped sums of the pieces and steps once.
"""

from __future__ import annotations

import math

import torch

from privacy.accounting import poisson_sample_rate

Tensors = dict[str, torch.Tensor]


def passes_batches(num_examples: int, batch_size: int) -> int:
    """Batches per pass of Opacus' Poisson sampler over a loader of ``batch_size``: ``int(1 / q)``."""
    return int(1 / poisson_sample_rate(num_examples, batch_size))


def expected_batch_size(num_examples: int, batch_size: int) -> int:
    """What ``DPOptimizer.scale_grad`` divides by: ``int(len(dataset) * (1 / len(loader)))``."""
    return int(num_examples * (1 / math.ceil(num_examples / batch_size)))


def poisson_masks(num_examples: int, batch_size: int, steps: int, batch_seed: int) -> torch.Tensor:
    """``[steps, num_examples]`` bool: which examples each logical batch of the round holds."""
    g = torch.Generator().manual_seed(batch_seed)
    q = poisson_sample_rate(num_examples, batch_size)
    per_pass = passes_batches(num_examples, batch_size)
    masks = torch.empty((steps, num_examples), dtype=torch.bool)
    taken = 0
    while taken < steps:
        torch.empty((), dtype=torch.int64).random_(generator=g)  # the DataLoader iterator's base seed
        for _ in range(min(per_pass, steps - taken)):
            masks[taken] = torch.rand(num_examples, generator=g) < q
            taken += 1
    return masks


def noise_draws(shapes: list[torch.Size], dtype: torch.dtype, std: float, steps: int, noise_seed: int,
                device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Per trainable parameter, ``[steps, *shape]``: the Gaussian noise (std ``σ·C``) of each logical step,
    drawn on ``device`` from a generator there, as Opacus draws it for a model on that device."""
    out = [torch.zeros((steps, *s), dtype=dtype, device=device) for s in shapes]
    if std == 0:  # Opacus draws nothing without noise
        return out
    g = torch.Generator(device=device).manual_seed(noise_seed)
    for s in range(steps):
        for buf, shape in zip(out, shapes):
            buf[s] = torch.normal(mean=0, std=std, size=shape, generator=g, dtype=dtype, device=device)
    return out


def privatise(per_sample: Tensors, mask: torch.Tensor, max_grad_norm: float, noise: Tensors,
              batch_size: torch.Tensor) -> Tensors:
    """Opacus' privatised gradient for a batch of clients.

    ``per_sample[n]`` is ``[C, W, *shape]`` (client, example slot), ``mask`` ``[C, W]`` marks the
    real examples, ``noise[n]`` is ``[C, *shape]`` and ``batch_size`` ``[C]`` the expected batch
    sizes; returns ``[C, *shape]`` per parameter.
    """
    norms = torch.stack([g.flatten(2).norm(2, dim=2) for g in per_sample.values()], dim=2).norm(2, dim=2)
    factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0) * mask
    return {n: (torch.einsum("cw,cw...->c...", factor.to(g.dtype), g) + noise[n])
            / batch_size.view(-1, *[1] * (g.dim() - 2)).to(g.dtype)
            for n, g in per_sample.items()}
