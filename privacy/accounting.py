"""Noise calibration and ε accounting with Opacus' accountants (PRV by default, RDP selectable).

Sampling rate: Opacus' Poisson loader samples each example with probability ``q = 1/⌈n/B⌉`` for a
client of ``n`` examples and logical batch ``B`` (exactly what ``make_private`` uses), so the same
``q`` is used to calibrate σ and to account ε here.

Calibration is honest by default: a client is assumed to take part in every round, so its number
of DP-SGD steps is ``rounds × local_steps``.  The FedSVD authors (``seanie12/fed-svd``
``client.py::dp_init``) fold the client-sampling fraction into the per-step rate,
``q' = q × fraction_train``; that is not a sound bound here (a sampled client runs all its local
steps of a round, so its steps are not independently subsampled, and Flower samples clients
without replacement), and fedsim does not offer it (``privacy.amplify_client_sampling`` was removed).
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path
from typing import Any

from opacus.accountants.utils import create_accountant, get_noise_multiplier

from fedsim.cache import atomic_write_bytes, cache_dir, key_of
from fedsim.errors import ConfigError


def poisson_sample_rate(num_examples: int, batch_size: int) -> float:
    """Opacus' per-example sampling probability for a loader of ``batch_size`` over ``num_examples``."""
    if num_examples < 1:
        raise ValueError("a DP client needs at least one example")
    return 1.0 / math.ceil(num_examples / batch_size)


@functools.lru_cache(maxsize=256)
def epsilon_for(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    """ε after ``steps`` DP-SGD steps at (σ, q), from Opacus' accountant ``accountant``."""
    if steps <= 0:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # RDP's "optimal order is the largest alpha"
        warnings.simplefilter("ignore", RuntimeWarning)  # PRV's log(1 - q) at q = 1
        return float(acc.get_epsilon(delta=delta))


#: Above this target ε the PRV accountant is slow (seconds per evaluation at σ < 0.5) and numerically
#: unreliable (ε = inf at σ = 0.1), so σ is calibrated with RDP instead, whose ε bounds PRV's from
#: above: the target still holds, with a little more noise than PRV would need.
PRV_MAX_TARGET = 20.0


@functools.lru_cache(maxsize=256)
def calibrate_noise(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """Smallest σ (to Opacus' tolerance) with ε(σ, q, steps) ≤ target, via Opacus' binary search.

    Targets above :data:`PRV_MAX_TARGET` are calibrated with the RDP accountant and a relative
    tolerance (0.1 % of ε), so even the largest accepted ε (1e3) calibrates in seconds.

    The search costs seconds (a 16 s share of a one-round DP run), so its result is also kept on
    disk (``$FEDSIM_CACHE/dp-sigma``, keyed by the arguments and Opacus' version); a cached σ is
    used only after one accountant call confirms ε(σ) ≤ target again, so a stale or damaged entry
    can cost time, never privacy.
    """
    path = _sigma_path(target_epsilon, delta, sample_rate, steps, accountant)
    cached = _read_sigma(path)
    if cached is not None and epsilon_for(cached, sample_rate, steps, delta, _used(accountant, target_epsilon)) \
            <= target_epsilon:
        return cached
    sigma = _search_noise(target_epsilon, delta, sample_rate, steps, accountant)
    atomic_write_bytes(path, json.dumps({"sigma": sigma}).encode())
    return sigma


def _used(accountant: str, target_epsilon: float) -> str:
    """The accountant the calibration uses (RDP above :data:`PRV_MAX_TARGET`)."""
    return "rdp" if accountant == "prv" and target_epsilon > PRV_MAX_TARGET else accountant


def _sigma_path(*args: Any) -> Path:
    import opacus

    return cache_dir() / "dp-sigma" / f"{key_of('calibrate_noise-v1', opacus.__version__, *args)}.json"


def _read_sigma(path: Path) -> float | None:
    try:
        sigma = float(json.loads(path.read_text())["sigma"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return sigma if math.isfinite(sigma) and sigma > 0 else None


def _search_noise(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    if accountant == "prv" and target_epsilon > PRV_MAX_TARGET:
        accountant = "rdp"
    tolerance = max(0.01, 1e-3 * target_epsilon)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            sigma = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                                         steps=steps, accountant=accountant, epsilon_tolerance=tolerance)
    except ValueError as exc:
        raise ConfigError(f"privacy: cannot reach ε={target_epsilon} at δ={delta} with {steps} steps at sampling "
                          f"rate {sample_rate:.4g} ({exc}); raise --eps or use fewer rounds/local steps") from None
    # Opacus' search stops within its tolerance from above; nudge σ up until the bound holds exactly.
    while epsilon_for(sigma, sample_rate, steps, delta, accountant) > target_epsilon:
        sigma *= 1.01
    return float(sigma)
