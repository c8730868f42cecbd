"""Norm-layer configuration for test-time adaptation, as the online TTA benchmark does it.

Reference: ``mariodoebler/test-time-adaptation`` ``classification/methods/tent.py`` /
``eata.py`` ``configure_model`` and ``collect_params`` (and ThunderDavid/LCoTTA's copy in
``methods/subspace_plus.py``): the model goes to eval mode, everything is frozen, BatchNorm layers
normalise with the statistics of the test batch, and the affine ``weight``/``bias`` of every
BatchNorm/LayerNorm/GroupNorm layer is trainable.  These affine parameters are the whole adapted
state; :func:`norm_state` / :func:`load_norm_state` move them (this is what a federated server
averages).

Deliberate deviations:

* ``BatchNorm1d`` is handled like ``BatchNorm2d`` (``track_running_stats=False``, running stats
  ``None``); the benchmark instead puts BN1d in train mode, which normalises with the same batch
  statistics but also keeps updating running statistics that are never used.  Outputs are equal;
  our buffers stay untouched.  ``BatchNorm3d``/``SyncBatchNorm`` (any ``_BatchNorm``) are covered.
* Other norms (InstanceNorm, RMSNorm) are not adapted, as in the benchmark.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedsim.errors import ConfigError

#: Module types whose affine parameters are adapted.
NORM_TYPES: tuple[type[nn.Module], ...] = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)


def has_batchnorm(model: nn.Module) -> bool:
    """True when the model contains a BatchNorm layer (its output then depends on the batch)."""
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def use_batch_stats(model: nn.Module) -> nn.Module:
    """Make every BatchNorm layer normalise with test-batch statistics (in eval mode too).

    Running statistics are dropped (``None``) so nothing is tracked or updated.
    """
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
    return model


def configure_norm(model: nn.Module) -> nn.Module:
    """Configure ``model`` in place for norm-affine TTA (Tent/EATA/LCoTTA); returns it.

    Eval mode (no dropout), all parameters frozen, BatchNorm on batch statistics, and the affine
    parameters of every BatchNorm/LayerNorm/GroupNorm trainable.
    """
    model.eval()
    model.requires_grad_(False)
    use_batch_stats(model)
    for m in model.modules():
        if isinstance(m, NORM_TYPES):
            m.requires_grad_(True)
    return model


def collect_norm_params(model: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
    """The affine parameters of the norm layers, in module order, and their full names.

    Collected by module type (not by ``requires_grad``), as the benchmark's ``collect_params``.
    """
    params: list[nn.Parameter] = []
    names: list[str] = []
    for mod_name, m in model.named_modules():
        if isinstance(m, NORM_TYPES):
            for p_name, p in m.named_parameters(recurse=False):
                if p_name in ("weight", "bias"):
                    params.append(p)
                    names.append(f"{mod_name}.{p_name}" if mod_name else p_name)
    return params, names


def norm_dim(model: nn.Module) -> int:
    """Total number of adapted scalars D (length of a flattened gradient snapshot)."""
    return sum(p.numel() for p in collect_norm_params(model)[0])


def norm_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the norm affine parameters, keyed by parameter name."""
    params, names = collect_norm_params(model)
    return {n: p.detach().clone() for n, p in zip(names, params)}


def load_norm_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`norm_state`) into the norm affine parameters, in place.

    Keys and shapes must match exactly; in-place copies keep optimiser references valid.
    """
    params, names = collect_norm_params(model)
    missing = sorted(set(names) - set(state))
    extra = sorted(set(state) - set(names))
    if missing or extra:
        raise ConfigError(
            f"norm state does not match the model (missing {missing[:3]}, unexpected {extra[:3]}); "
            "pass the dict returned by norm_state() of the same architecture"
        )
    with torch.no_grad():
        for n, p in zip(names, params):
            v = torch.as_tensor(state[n])
            if tuple(v.shape) != tuple(p.shape):
                raise ConfigError(
                    f"norm state {n!r} has shape {tuple(v.shape)}, the model needs {tuple(p.shape)}"
                )
            p.copy_(v.to(device=p.device, dtype=p.dtype))
