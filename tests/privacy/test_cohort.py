"""privacy/cohort.py draws what Opacus draws: the Poisson batches of a client's loader and the
noise of its DPOptimizer, from the same seeds (checked against a real Opacus round)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedsim import config as C
from privacy.cohort import expected_batch_size, noise_draws, passes_batches, poisson_masks
from privacy.dp_sgd import private_local_training


def privacy(physical: int = 64) -> C.PrivacyConfig:
    cfg = C.load_config("fedavg_digits", ["privacy.enabled=true", "privacy.noise_multiplier=1.0",
                                          f"privacy.max_physical_batch_size={physical}"], {})
    return cfg.privacy


@pytest.mark.parametrize("n, batch_size, steps, physical", [(5, 2, 11, 64), (37, 8, 13, 3), (3, 16, 4, 64),
                                                           (50, 16, 9, 5), (49, 1, 60, 64)])
def test_poisson_masks_are_the_batches_opacus_yields(n: int, batch_size: int, steps: int, physical: int) -> None:
    seen: list[list[int]] = []
    model = nn.Linear(1, 2)
    model.register_forward_hook(lambda mod, inp, out: seen.append(inp[0][:, 0].long().tolist()))
    x, y = torch.arange(n, dtype=torch.float32).view(-1, 1), torch.zeros(n, dtype=torch.long)
    out = private_local_training(model, torch.optim.SGD(model.parameters(), lr=0.0), (x, y), privacy=privacy(physical),
                                 batch_size=batch_size, steps=steps, noise_multiplier=1.0, batch_seed=7, noise_seed=3)
    masks = poisson_masks(n, batch_size, steps, batch_seed=7)
    assert out.steps == steps == len(masks)
    # physical batches are pieces of the logical ones, in order (empty logical batches run as empty)
    assert [i for b in seen for i in b] == [int(i) for m in masks for i in m.nonzero().view(-1)]
    assert out.examples_seen == int(masks.sum())


def test_noise_draws_are_the_optimizers_noise() -> None:
    """A loss of 0 leaves only the noise: one SGD step at lr 1 moves each weight by -noise / expected batch."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    n, b, sigma, clip = 20, 6, 1.3, 0.7
    p = privacy()
    p.max_grad_norm = clip
    private_local_training(model, torch.optim.SGD(model.parameters(), lr=1.0), (torch.randn(n, 3), torch.zeros(n).long()),
                           privacy=p, batch_size=b, steps=3, noise_multiplier=sigma, batch_seed=1, noise_seed=5,
                           loss=lambda module, batch: (module(batch[0]) * 0).sum())
    draws = noise_draws([q.shape for q in before], torch.float32, sigma * clip, 3, noise_seed=5)
    for q, w0, d in zip(model.parameters(), before, draws):
        assert torch.allclose(q.detach(), w0 - d.sum(0) / expected_batch_size(n, b), atol=1e-6)


def test_no_noise_draws_nothing_and_the_rates_are_opacus_own() -> None:
    assert all(not d.any() for d in noise_draws([torch.Size([2, 3])], torch.float32, 0.0, 4, noise_seed=1))
    assert expected_batch_size(10, 3) == 2 and passes_batches(10, 3) == 4  # q = 1/4, int(10 * 0.25)
    assert expected_batch_size(3, 16) == 3 and passes_batches(3, 16) == 1
