"""One client's local DP-SGD round with Opacus (sample-level DP).

Opacus' ``make_private`` gives Poisson sampling (each example joins a logical batch with
probability ``q``), per-sample gradient clipping at ``max_grad_norm`` and Gaussian noise of std
``σ·C``; ``BatchMemoryManager`` splits logical batches into physical ones of at most
``max_physical_batch_size``.  The round runs exactly ``steps`` logical (non-skipped) optimizer
steps, as the FedSVD authors' ``dp_train`` does.  Batch sampling and noise use generators seeded
from the run's root seed, so runs are reproducible (``secure_mode`` is off: this is a simulator); the
noise generator lives on the model's device (``engine.device``), so a GPU run draws other noise than
a CPU run of the same seed, reproducibly.

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
from typing import Any, Callable, Optional, Sequence

import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsim.config import PrivacyConfig

#: ``loss(module, batch) -> mean loss over the batch's examples``; ``batch`` is a tuple of tensors.
LossFn = Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor]


@dataclass
class DPRoundResult:
    mean_loss: float
    steps: int  # logical DP-SGD steps taken (what the accountant counts)
    examples_seen: int


def private_local_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Sequence[torch.Tensor],
    *,
    privacy: PrivacyConfig,
    batch_size: int,
    steps: int,
    noise_multiplier: float,
    batch_seed: int,
    noise_seed: int,
    loss: Optional[LossFn] = None,
    criterion: Optional[nn.Module] = None,
    after_noise: Optional[Callable[[], None]] = None,
) -> DPRoundResult:
    """Run ``steps`` DP-SGD steps on the examples ``data`` (tensors sharing their first dimension; one
    row is one protected example); the model is left unwrapped.

    The batch loss is ``loss(module, batch)`` or, by default, ``criterion`` (cross-entropy) of
    ``module(batch[0])`` against ``batch[1]``.  ``after_noise`` edits the parameters' privatised
    ``.grad`` before each step.
    """
    if loss is not None and privacy.grad_sample_mode == "ghost":
        raise ValueError("privacy.grad_sample_mode=ghost needs an (output, target) criterion, not a loss function")
    with warnings.catch_warnings():
        # Opacus' known notices: "Secure RNG turned off" (intended: seeded simulation) and the
        # full-backward-hook notice for frozen inputs.
        warnings.simplefilter("ignore", UserWarning)
        if after_noise is not None:
            _run_before_step(optimizer, after_noise)
        try:
            return _run(model, optimizer, tuple(data), privacy, batch_size, steps, noise_multiplier, batch_seed,
                        noise_seed, criterion if criterion is not None else nn.CrossEntropyLoss(), loss)
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


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters live: Opacus draws the noise there (on a GPU, CUDA's stream, not
    the CPU's, for the same seed), so the noise generator and every batch go there too."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _no_examples(optimizer: Any) -> None:
    """The per-sample gradients of an empty batch (zero rows each), what a forward on zero rows leaves.

    Opacus runs the step of an empty logical batch as any other (clip nothing, add the noise, divide by
    the expected batch size); the forward is skipped because not every model takes zero rows (Hugging
    Face encoders reshape ``[0, heads, -1, dim]`` and fail)."""
    for p in optimizer.params:
        p.grad_sample = p.new_zeros((0, *p.shape))


def _run(model: nn.Module, optimizer: torch.optim.Optimizer, data: tuple[torch.Tensor, ...],
         privacy: PrivacyConfig, batch_size: int, steps: int, noise_multiplier: float, batch_seed: int,
         noise_seed: int, loss_module: nn.Module, loss_fn: Optional[LossFn]) -> DPRoundResult:
    loader = DataLoader(TensorDataset(*data), batch_size=batch_size,
                        generator=torch.Generator().manual_seed(batch_seed))
    engine = PrivacyEngine(accountant=privacy.accountant, secure_mode=False)
    device = model_device(model)
    kwargs = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
                  max_grad_norm=privacy.max_grad_norm, poisson_sampling=True,
                  grad_sample_mode=privacy.grad_sample_mode,
                  noise_generator=torch.Generator(device=device).manual_seed(noise_seed))
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
                for batch in physical:
                    batch = [t.to(device) for t in batch]  # Opacus builds an empty batch on the CPU
                    dp_opt.zero_grad(set_to_none=True)
                    n = len(batch[0])
                    if n == 0 and privacy.grad_sample_mode != "ghost":
                        _no_examples(dp_opt)  # an empty Poisson batch: no forward, Opacus steps on noise alone
                    else:
                        loss = loss_fn(module, batch) if loss_fn is not None else criterion(module(batch[0]), batch[1])
                        loss.backward()
                    dp_opt.step()
                    seen += n
                    if n:
                        loss_sum += float(loss.detach().item()) * n
                    if not dp_opt._is_last_step_skipped:
                        taken += 1
                        if taken == steps:
                            break
    finally:
        dp_opt.zero_grad(set_to_none=True)
        if hasattr(module, "_close"):
            module._close()  # remove Opacus hooks and grad_sample buffers from the resident model
    return DPRoundResult(mean_loss=loss_sum / max(seen, 1), steps=taken, examples_seen=seen)
