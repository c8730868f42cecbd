"""DP-FedProx: FedProx's proximal gradient is added to the privatised gradient (after clipping and
noising), so FedProx runs under DP with the ledger of FedAvg, and the term acts exactly as mu (w - w0)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedsim import config as C
from fedsim.runner import run_experiment
from privacy.dp_sgd import private_local_training

DIGITS = ["data.name=digits", "model.name=mlp", "data.partition.name=iid", "client.local_steps=3",
          "privacy.enabled=true", "privacy.epsilon=3.0"]


def _train(model: nn.Module, steps: int, hook=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private_local_training(model, opt, (x, y), privacy=C.PrivacyConfig(enabled=True, max_physical_batch_size=64),
                           batch_size=16, steps=steps, noise_multiplier=1.0, batch_seed=1, noise_seed=2,
                           after_noise=hook)
    assert "step" not in opt.__dict__  # the optimiser is plain again
    return model.weight.detach().clone()


def test_proximal_gradient_is_added_after_noise_exactly() -> None:
    """Step 1 starts at w0 (no pull); step 2 differs from plain DP-SGD by exactly -lr * mu * (w1 - w0)."""
    torch.manual_seed(0)
    base = nn.Linear(4, 3, bias=False)
    w0 = base.weight.detach().clone()
    mu, lr = 0.7, 0.1
    w1 = _train(copy.deepcopy(base), steps=1)
    plain = _train(copy.deepcopy(base), steps=2)
    model = copy.deepcopy(base)

    @torch.no_grad()
    def pull() -> None:
        model.weight.grad.add_(model.weight - w0, alpha=mu)

    prox = _train(model, steps=2, hook=pull)
    assert not torch.equal(w1, w0)
    torch.testing.assert_close(prox - plain, -lr * mu * (w1 - w0), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parallel
def test_fedprox_under_dp_spends_what_fedavg_spends() -> None:
    def run(*extra: str):
        cfg = C.load_config("fedavg", [*DIGITS, *extra], {"rounds": 2, "clients": 3})
        cfg.tracking.enabled = False
        return run_experiment(cfg)

    prox, avg = run("strategy.name=fedprox", "strategy.params.mu=1.0"), run()
    assert prox.history.final()["privacy/epsilon_max"] == avg.history.final()["privacy/epsilon_max"] <= 3.0
    assert prox.history.final()["eval/loss"] != avg.history.final()["eval/loss"]
