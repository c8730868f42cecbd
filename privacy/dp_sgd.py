"""One client's local DP-SGD round with Opacus (sample-level DP).

Opacus' ``make_private`` gives Poisson sampling (each example joins a logical batch with
probability ``q``), per-sample gradient clipping at ``max_grad_norm`` and Gaussian noise of std
``σ·C``; ``BatchMemoryManager`` splits logical batches into physical ones of at most
``max_physical_batch_size``.  The round runs exactly ``steps`` logical (non-skipped) optimizer
steps, as the FedSVD authors' ``dp_train`` does.  Batch sampling and noise use generators seeded
from the run's root seed, so runs are reproducible (``secure_mode`` is off: this is a simulator).

The loss is the caller's (``criterion``, any mean-reduced per-example loss module; cross-entropy by
default).  ``after_noise`` adds a *data-independent* term to the privatised gradient just before
each logical step (after clipping and noising, so it costs no privacy: post-processing), which is
how DP-FedProx adds FedProx's proximal gradient ``mu (w - w_global)`` (it is not a per-example
loss and must not be clipped with the data's gradients).

The learner's model stays resident: the Opacus wrapper is removed after the round (hooks and
``grad_sample`` buffers are cleaned up), so the next round starts from a plain module.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsim.config import PrivacyConfig


@dataclass
class DPRoundResult:
    mean_loss: float
    steps: int  # logical DP-SGD steps taken (what the accountant counts)
    examples_seen: int


def private_local_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    privacy: PrivacyConfig,
    batch_size: int,
    steps: int,
    noise_multiplier: float,
    batch_seed: int,
    noise_seed: int,
    criterion: Optional[nn.Module] = None,
    after_noise: Optional[Callable[[], None]] = None,
) -> DPRoundResult:
    """Run ``steps`` DP-SGD steps minimising ``criterion`` (default cross-entropy) on (x, y); the model
    is left unwrapped.  ``after_noise`` edits the parameters' privatised ``.grad`` before each step."""
    with warnings.catch_warnings():
        # Opacus' known notices: "Secure RNG turned off" (intended: seeded simulation) and the
        # full-backward-hook notice for frozen inputs.
        warnings.simplefilter("ignore", UserWarning)
        if after_noise is not None:
            _run_before_step(optimizer, after_noise)
        try:
            return _run(model, optimizer, x, y, privacy, batch_size, steps, noise_multiplier, batch_seed, noise_seed,
                        criterion if criterion is not None else nn.CrossEntropyLoss())
        finally:
            optimizer.__dict__.pop("step", None)  # the plain optimizer again


def _run_before_step(optimizer: torch.optim.Optimizer, hook: Callable[[], None]) -> None:
    """Make ``optimizer.step`` call ``hook`` first.  Opacus' DPOptimizer calls its wrapped optimizer's
    ``step`` only for a logical step, after clipping and noising: so ``hook`` sees the noised gradient."""
    step = optimizer.step

    def step_after_hook(*args, **kwargs):  # type: ignore[no-untyped-def]
        hook()
        return step(*args, **kwargs)

    optimizer.step = step_after_hook  # type: ignore[method-assign]


def _run(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
         privacy: PrivacyConfig, batch_size: int, steps: int, noise_multiplier: float, batch_seed: int,
         noise_seed: int, loss_module: nn.Module) -> DPRoundResult:
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size,
                        generator=torch.Generator().manual_seed(batch_seed))
    engine = PrivacyEngine(accountant=privacy.accountant, secure_mode=False)
    kwargs = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
                  max_grad_norm=privacy.max_grad_norm, poisson_sampling=True,
                  grad_sample_mode=privacy.grad_sample_mode,
                  noise_generator=torch.Generator().manual_seed(noise_seed))
    if privacy.grad_sample_mode == "ghost":
        module, dp_opt, criterion, dp_loader = engine.make_private(criterion=loss_module, **kwargs)
    else:
        module, dp_opt, dp_loader = engine.make_private(**kwargs)
        criterion = loss_module
    taken, loss_sum, seen = 0, 0.0, 0
    try:
        module.train()
        while taken < steps:
            with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=privacy.max_physical_batch_size,
                                    optimizer=dp_opt) as physical:
                for xb, yb in physical:
                    dp_opt.zero_grad(set_to_none=True)
                    loss = criterion(module(xb), yb)
                    loss.backward()
                    dp_opt.step()
                    seen += len(yb)
                    if len(yb):
                        loss_sum += float(loss.detach().item()) * len(yb)
                    if not dp_opt._is_last_step_skipped:
                        taken += 1
                        if taken == steps:
                            break
    finally:
        dp_opt.zero_grad(set_to_none=True)
        if hasattr(module, "_close"):
            module._close()  # remove Opacus hooks and grad_sample buffers from the resident model
    return DPRoundResult(mean_loss=loss_sum / max(seen, 1), steps=taken, examples_seen=seen)
