"""Degradations: Gaussian-MTF downsampling (Wald protocol), upsampling, synthetic low light.

**Downsampling** by an integer ``factor`` blurs with a Gaussian and decimates in one separable linear
map.  Low-resolution pixel ``i`` covers the high-resolution pixels ``[i·f, (i+1)·f)``, so its value is
the Gaussian-weighted mean of the high-resolution pixels around the centre ``c_i = i·f + (f−1)/2``:

    w_ij ∝ exp(−(j − c_i)² / 2σ²)   for |j − c_i| ≤ m + (f−1)/2,   m = ⌈3σ⌉,

normalised per output pixel (at the borders the truncated weights are renormalised, so a constant
image stays exactly constant).  In the interior this is exactly the window
``img[i·f−m : i·f+f+m]`` weighted by :func:`gaussian_kernel` ``(f + 2m, σ)``.  The default σ makes the
filter's MTF equal 0.3 at the low-resolution Nyquist frequency 1/(2f) — the usual Wald-protocol
MTF-matched filter for multispectral sensors (Vivone et al.):

    σ = f·sqrt(−2 ln 0.3)/π ≈ 0.494·f    (σ ≈ 1.98 high-resolution pixels for f = 4).

The output has ⌊H/f⌋×⌊W/f⌋ pixels (trailing rows/columns that do not fill a block are ignored).
The pixel-centre convention matches :func:`upsample` (PyTorch ``align_corners=False``).
"""

from __future__ import annotations

import math

import numpy as np

#: MTF gain at the low-resolution Nyquist frequency that fixes the default σ.
NYQUIST_GAIN = 0.3


def default_sigma(factor: int) -> float:
    """σ (high-resolution pixels) of the Gaussian whose MTF is :data:`NYQUIST_GAIN` at 1/(2·factor)."""
    return factor * math.sqrt(-2.0 * math.log(NYQUIST_GAIN)) / math.pi


def gaussian_kernel(size: int, sigma: float) -> np.ndarray:
    """A normalised ``size``×``size`` Gaussian centred at ((size−1)/2, (size−1)/2) (float64)."""
    if size < 1 or sigma <= 0:
        raise ValueError(f"gaussian_kernel: need size >= 1 and sigma > 0, got {size}, {sigma}")
    t = np.arange(size) - (size - 1) / 2.0
    g = np.exp(-t ** 2 / (2.0 * sigma ** 2))
    k = np.outer(g, g)
    return k / k.sum()


def decimation_matrix(n: int, factor: int, sigma: float) -> np.ndarray:
    """The ⌊n/f⌋×n matrix of blur-and-decimate weights along one axis (rows sum to 1)."""
    m = math.ceil(3.0 * sigma)
    out = n // factor
    centres = np.arange(out) * factor + (factor - 1) / 2.0
    d = np.arange(n)[None, :] - centres[:, None]
    w = np.exp(-d ** 2 / (2.0 * sigma ** 2)) * (np.abs(d) <= m + (factor - 1) / 2.0)
    return w / w.sum(axis=1, keepdims=True)


def downsample(img: np.ndarray, factor: int, sigma: float | None = None) -> np.ndarray:
    """Gaussian-MTF blur then decimation by ``factor`` of an H×W(×C) image (see the module docstring)."""
    if factor < 1 or img.shape[0] < factor or img.shape[1] < factor:
        raise ValueError(f"downsample: factor must be in [1, min(H, W)], got {factor} for {img.shape[:2]}")
    if factor == 1 and sigma is None:
        return img.copy()
    s = default_sigma(factor) if sigma is None else float(sigma)
    rows = decimation_matrix(img.shape[0], factor, s)
    cols = decimation_matrix(img.shape[1], factor, s)
    h, w = img.shape[:2]
    rest = img.shape[2:]
    x = img.astype(np.float64).reshape(h, -1)
    x = (rows @ x).reshape(rows.shape[0], w, -1)                   # blur + decimate rows
    x = np.einsum("lk,ikc->ilc", cols, x, optimize=True)          # blur + decimate columns
    out = x.reshape(rows.shape[0], cols.shape[0], *rest)
    return out.astype(img.dtype if img.dtype.kind == "f" else np.float32)


_MODES = {"bicubic": "bicubic", "bilinear": "bilinear", "nearest": "nearest"}


def upsample(img: np.ndarray, factor: int, mode: str = "bicubic", clip: bool = True) -> np.ndarray:
    """Interpolate an H×W(×C) image to (H·f)×(W·f) (PyTorch, ``align_corners=False``; bicubic is Keys
    a = −0.75).  ``clip`` keeps the result in [0, 1] (bicubic overshoots at edges)."""
    import torch
    import torch.nn.functional as F

    if mode not in _MODES:
        raise ValueError(f"upsample: mode must be one of {sorted(_MODES)}, got {mode!r}")
    if factor < 1:
        raise ValueError(f"upsample: factor must be >= 1, got {factor}")
    x = torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32))
    x = (x[None, None] if x.ndim == 2 else x.permute(2, 0, 1)[None])
    kw = {} if mode == "nearest" else {"align_corners": False}
    y = F.interpolate(x, scale_factor=factor, mode=_MODES[mode], **kw)[0]
    y = y[0] if img.ndim == 2 else y.permute(1, 2, 0)
    if clip:
        y = y.clamp(0.0, 1.0)
    return y.contiguous().numpy()


def darken(img: np.ndarray, gain: float, gamma: float, noise_std: float, rng: np.random.Generator) -> np.ndarray:
    """Synthetic low light: ``clip(gain·x^gamma + N(0, noise_std²), 0, 1)`` (float32)."""
    if gain <= 0 or gamma <= 0 or noise_std < 0:
        raise ValueError(f"darken: need gain > 0, gamma > 0, noise_std >= 0, got {gain}, {gamma}, {noise_std}")
    x = gain * np.power(np.clip(img, 0.0, 1.0).astype(np.float64), gamma)
    if noise_std > 0:
        x = x + rng.normal(0.0, noise_std, size=img.shape)
    return np.clip(x, 0.0, 1.0).astype(np.float32)
