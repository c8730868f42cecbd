"""Hierarchical luminance layers: the γ-map pooled onto 2^i regions, x^γ, bilateral filter, MSRCR fusion.

Follows ``Gamma_Diff.partition_gamma`` / ``enhance_with_gamma`` on ``B×3×H×W`` tensors in [0, 1]:

1. γ (the Metropolis draw) is average-pooled in blocks of ``H//g × W//g`` pixels, ``g = ⌊√(2^i)⌋``
   (1, 1, 2, 2, 4, 5, 8, 11, 16, 22 for levels 0..9; so the actual grid is ``H // (H//g)`` blocks a
   side, e.g. 16 rather than 11 on 32 pixels, and rows/columns left over by the pooling are covered by
   the nearest upsampling back to H×W), and the image is raised to it;
   ``regions ≥ H·W`` keeps the per-pixel map (the "pixel" reference layer);
2. a 3×3 bilateral filter (σ_colour = σ_space = 45 on the 0..255 scale, L1 colour distance, as kornia);
3. chroma denoising (YUV, 5×5 Gaussian σ = 1 on U and V);
4. fusion with MSRCR (σ ∈ {15, 80, 250}, G = 4, b = 25, α = 125, β = 46 on the 0..255 scale) by a
   one-level Haar wavelet with weights 0.64 / 0.36 on every band — the Haar transform is linear and
   invertible, so equal band weights make it exactly the pixel blend 0.64·a + 0.36·b, which is what
   we compute (for even sizes; for odd sizes the authors' padding differs in the last row/column);
5. a final 3×3 bilateral filter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from central.lasq.gamma import GammaConfig, _odd_kernel_size, gaussian_blur, sampled_gamma

RGB_TO_YUV = torch.tensor([[0.299, 0.587, 0.114], [-0.147, -0.289, 0.436], [0.615, -0.515, -0.100]])
MSRCR_SIGMAS = (15.0, 80.0, 250.0)


def grid_size(regions: int) -> int:
    """Side of the pooling grid for ``regions`` regions (the authors' ``int(regions ** 0.5)``)."""
    return max(1, int(regions ** 0.5))


def level_regions(level: int) -> int:
    """Number of regions of layer ``level``: 2^level."""
    return 2 ** level


def pool_gamma(gamma: torch.Tensor, regions: int) -> torch.Tensor:
    """Average γ over a ``g×g`` grid of ``H//g × W//g`` blocks and stretch it back to H×W (nearest)."""
    H, W = gamma.shape[-2:]
    if regions >= H * W:
        return gamma
    g = grid_size(regions)
    ph, pw = max(1, H // g), max(1, W // g)
    pooled = F.avg_pool2d(gamma, kernel_size=(ph, pw), stride=(ph, pw))
    return F.interpolate(pooled, size=(H, W), mode="nearest")


def bilateral3(x: torch.Tensor, sigma_color: float = 45.0 / 255.0, sigma_space: float = 45.0) -> torch.Tensor:
    """3×3 bilateral filter on [0, 1] images (kornia's: reflect border, L1 colour distance over channels)."""
    B, C, H, W = x.shape
    patches = F.unfold(F.pad(x, (1, 1, 1, 1), mode="reflect"), 3).view(B, C, 9, H, W)
    offsets = torch.tensor([-1.0, 0.0, 1.0])
    d2 = (offsets.view(3, 1) ** 2 + offsets.view(1, 3) ** 2).flatten()
    spatial = torch.exp(-d2 / (2 * sigma_space ** 2)).view(1, 9, 1, 1)
    diff = (patches - x.unsqueeze(2)).abs().sum(1)  # B×9×H×W
    weights = spatial * torch.exp(-0.5 * (diff / sigma_color) ** 2)
    return (patches * weights.unsqueeze(1)).sum(2) / weights.sum(1, keepdim=True)


def gamma_layer(x: torch.Tensor, gamma: torch.Tensor, regions: int) -> torch.Tensor:
    """x raised to the γ-map pooled on ``regions`` regions, then bilateral-filtered (``partition_gamma``)."""
    return bilateral3(torch.clamp(x.pow(pool_gamma(gamma, regions)), 0.0, 1.0))


def color_denoise(x: torch.Tensor) -> torch.Tensor:
    """Blur the chroma (U, V) with a 5×5 Gaussian, σ = 1, keep the luma."""
    m = RGB_TO_YUV.to(x.dtype)
    yuv = torch.einsum("ij,bjhw->bihw", m, x)
    uv = gaussian_blur(yuv[:, 1:], 1.0, 5)
    yuv = torch.cat([yuv[:, :1], uv], dim=1)
    return torch.einsum("ij,bjhw->bihw", torch.linalg.inv(m), yuv).clamp(0.0, 1.0)


def msrcr(x: torch.Tensor, sigmas: tuple[float, ...] = MSRCR_SIGMAS, G: float = 4.0, b: float = 25.0,
          alpha: float = 125.0, beta: float = 46.0) -> torch.Tensor:
    """The authors' MSRCR (on the 0..255 scale, +1 offset, no histogram stretch), returned in [0, 1]."""
    img = x * 255.0 + 1.0
    H, W = x.shape[-2:]
    retinex = torch.zeros_like(img)
    for s in sigmas:
        k = max(3, _odd_kernel_size(s, min(H, W) - 1, "retinex"))
        retinex += torch.log10(img + 1e-6) - torch.log10(gaussian_blur(img, s, k) + 1e-6)
    retinex = retinex / len(sigmas)
    color = beta * (torch.log10(alpha * img + 1e-6) - torch.log10(img.sum(1, keepdim=True) + 1e-6))
    return torch.clamp(G * (retinex * color + b), 0.0, 255.0) / 255.0


def wavelet_fuse(a: torch.Tensor, b: torch.Tensor, wa: float = 0.64, wb: float = 0.36) -> torch.Tensor:
    """One-level Haar fusion with the same weights on every band = the pixel blend wa·a + wb·b."""
    return (wa * a + wb * b).clamp(0.0, 1.0)


def enhance_with_gamma(x: torch.Tensor, regions: int | list[int], cfg: GammaConfig, generator: torch.Generator,
                       use_msrcr: bool = True, msrcr_img: torch.Tensor | None = None) -> torch.Tensor:
    """The authors' pseudo-target: fresh Metropolis γ, layer(s) at ``regions`` (per image if a list), fusion."""
    gamma = sampled_gamma(x, cfg, generator)
    counts = [regions] * x.shape[0] if isinstance(regions, int) else list(regions)
    out = torch.empty_like(x)
    for r in sorted(set(counts)):  # one pass per distinct level, vectorised over the images at that level
        idx = torch.tensor([i for i, c in enumerate(counts) if c == r])
        out[idx] = gamma_layer(x[idx], gamma[idx], r)
    out = color_denoise(out)
    if use_msrcr:
        out = wavelet_fuse(out, msrcr(x) if msrcr_img is None else msrcr_img)
    return bilateral3(out)
