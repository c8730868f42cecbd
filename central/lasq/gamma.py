"""Base luminance, the initial power-law exponent γ₀ and the Metropolis sampling of the γ-map.

Everything works on batches of images ``B×C×H×W`` in [0, 1] (torch, float32) and is vectorised over the
batch, the channels and the pixels: one Metropolis chain per image, one accept/reject per image and step
(the authors call their sampler on one image at a time, so their batch-wide acceptance is per image too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

AUTHORS_SIGMAS = (20.0, 50.0, 150.0, 250.0)  # Gamma_Diff.compute_base_gamma, for ~512-pixel images


@dataclass(frozen=True)
class GammaConfig:
    """The γ-map settings (the authors' values unless stated)."""

    sigmas: tuple[float, ...] = (10.0, 25.0, 75.0, 125.0)  # the authors' /2: our images are ~256 px, theirs ~512
    gamma_base: float = 3.5
    mcmc_steps: int = 16  # the authors' ``args.mcmc_steps`` default (commented in Gamma_Diff.py); 4 in the signature
    proposal_std: float = 0.03
    temperature: float = 0.02
    gamma_min: float = 0.3
    gamma_max: float = 3.5
    exposure_target: float = 0.55
    smooth_weight: float = 0.1
    structure_weight: float = 0.1


def _odd_kernel_size(sigma: float, limit: int, rule: str) -> int:
    """The authors' kernel sizes: ``4σ+1`` (luminance) or ``2·round(3σ)+1`` (retinex), capped, made odd."""
    k = int(4 * sigma + 1) if rule == "illum" else int(2 * round(3 * sigma) + 1)
    k = min(k, limit)
    if k % 2 == 0:
        k -= 1
    return max(k, 1)


def gaussian_blur(x: torch.Tensor, sigma: float, ksize: int) -> torch.Tensor:
    """Separable Gaussian blur with reflect borders (kornia's ``gaussian_blur2d`` default)."""
    if ksize <= 1:
        return x
    r = ksize // 2
    coords = torch.arange(ksize, dtype=x.dtype, device=x.device) - r
    k = torch.exp(-(coords ** 2) / (2 * sigma ** 2))
    k = k / k.sum()
    C = x.shape[1]
    kh = k.view(1, 1, ksize, 1).expand(C, 1, ksize, 1)
    kw = k.view(1, 1, 1, ksize).expand(C, 1, 1, ksize)
    y = F.conv2d(F.pad(x, (0, 0, r, r), mode="reflect"), kh, groups=C)
    return F.conv2d(F.pad(y, (r, r, 0, 0), mode="reflect"), kw, groups=C)


def base_luminance(x: torch.Tensor, sigmas: tuple[float, ...]) -> torch.Tensor:
    """L = mean of Gaussian blurs of the image (per channel), kernel ``4σ+1`` capped at min(H, W)."""
    H, W = x.shape[-2:]
    blurs = [gaussian_blur(x, s, _odd_kernel_size(s, min(H, W), "illum")) for s in sigmas]
    return torch.stack(blurs).mean(0)


def initial_gamma(L: torch.Tensor, gamma_base: float = 3.5) -> torch.Tensor:
    """γ₀ = (γ_base + L)^(2L − 1): below 1 (brighten) where L < 0.5, above 1 (darken) where L > 0.5."""
    return torch.pow(gamma_base + L, 2 * L - 1)


def apply_gamma(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x.pow(gamma), 0.0, 1.0)


def _mean_abs_grad(z: torch.Tensor) -> torch.Tensor:
    """Per image: mean |∂_h z| + mean |∂_w z| (the authors' gradient/TV term)."""
    dh = (z[:, :, 1:, :] - z[:, :, :-1, :]).abs().flatten(1).mean(1)
    dw = (z[:, :, :, 1:] - z[:, :, :, :-1]).abs().flatten(1).mean(1)
    return dh + dw


def gamma_energy(gamma: torch.Tensor, x: torch.Tensor, cfg: GammaConfig = GammaConfig(),
                 x_grad: torch.Tensor | None = None) -> torch.Tensor:
    """Per-image energy |mean(x^γ) − 0.55| + 0.1·TV(γ) + 0.1·|‖∇x‖ − ‖∇x^γ‖| (shape ``B``)."""
    enhanced = apply_gamma(x, gamma)
    exposure = (enhanced.flatten(1).mean(1) - cfg.exposure_target).abs()
    smooth = _mean_abs_grad(gamma)
    gx = _mean_abs_grad(x) if x_grad is None else x_grad
    structure = (gx - _mean_abs_grad(enhanced)).abs()
    return exposure + cfg.smooth_weight * smooth + cfg.structure_weight * structure


def metropolis_accept(delta: torch.Tensor, temperature: float, u: torch.Tensor) -> torch.Tensor:
    """Accept where u < exp(−ΔE / T), i.e. with probability min(1, exp(−ΔE / T))."""
    return u < torch.exp(-delta / temperature)


@dataclass
class ChainTrace:
    """Per-step record of a chain: energies (before the first step and after each) and acceptances."""

    energies: list[torch.Tensor] = field(default_factory=list)
    accepted: list[torch.Tensor] = field(default_factory=list)

    def acceptance_rate(self) -> float:
        return float(torch.stack(self.accepted).float().mean()) if self.accepted else float("nan")


def mcmc_sample_gamma(x: torch.Tensor, gamma0: torch.Tensor, cfg: GammaConfig, generator: torch.Generator,
                      trace: ChainTrace | None = None) -> torch.Tensor:
    """Metropolis on the whole γ-map: propose γ + N(0, std²) per pixel, clamp, accept per image."""
    gamma = gamma0.clamp(cfg.gamma_min, cfg.gamma_max)  # deviation: the authors clamp proposals only
    x_grad = _mean_abs_grad(x)
    energy = gamma_energy(gamma, x, cfg, x_grad)
    if trace is not None:
        trace.energies.append(energy.clone())
    for _ in range(cfg.mcmc_steps):
        noise = torch.randn(gamma.shape, generator=generator, dtype=gamma.dtype)
        proposal = torch.clamp(gamma + cfg.proposal_std * noise, cfg.gamma_min, cfg.gamma_max)
        e_new = gamma_energy(proposal, x, cfg, x_grad)
        u = torch.rand(energy.shape, generator=generator, dtype=energy.dtype)
        accept = metropolis_accept(e_new - energy, cfg.temperature, u)
        gamma = torch.where(accept.view(-1, 1, 1, 1), proposal, gamma)
        energy = torch.where(accept, e_new, energy)
        if trace is not None:
            trace.energies.append(energy.clone())
            trace.accepted.append(accept)
    return gamma


def sampled_gamma(x: torch.Tensor, cfg: GammaConfig, generator: torch.Generator,
                  trace: ChainTrace | None = None) -> torch.Tensor:
    """γ₀ from the base luminance, then the Metropolis chain (one draw per image)."""
    gamma0 = initial_gamma(base_luminance(x, cfg.sigmas), cfg.gamma_base)
    return mcmc_sample_gamma(x, gamma0, cfg, generator, trace)


def global_gamma(x: torch.Tensor, gamma_base: float = 3.5) -> torch.Tensor:
    """One exponent per image from the γ₀ formula at the global mean: (γ_base + m)^(2m − 1), shape B×1×1×1."""
    m = x.flatten(1).mean(1).view(-1, 1, 1, 1)
    return initial_gamma(m, gamma_base)
