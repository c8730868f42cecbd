"""Synthetic 4-band multispectral + PAN scenes from the offline RGB images, under the Wald protocol.

For an RGB image (cropped to a multiple of :data:`RATIO`), the *original* (reference) MS image is

* bands 1–3: R, G, B;
* band 4, a synthetic NIR: ``clip((0.10 + 0.25·R + 0.55·G − 0.10·B)·(1 + 0.15·t), 0, 1)`` with ``t`` a
  fixed texture (unit-variance white noise, Gaussian-smoothed with σ = 1 px, seeded by the image
  name) — NIR detail that the RGB bands do not contain [I: our choice];

and the PAN band is the spectral-weighted mean ``Σ_b w_b·MS_b`` with w = (0.25, 0.30, 0.15, 0.30).
Wald protocol (reduced resolution): the MS image is degraded ×4 with the kit's Gaussian-MTF filter
(MTF 0.3 at Nyquist, σ ≈ 1.98 px) and decimated; a method sees only that low-resolution MS
(upsampled bicubically back to the PAN grid) and the PAN, and its output is compared with the
original MS.  Training uses aligned crops of (upsampled MS, PAN, original MS) from the training
images; evaluation uses whole held-out images.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np
from scipy.ndimage import gaussian_filter

from central.image import downsample, load_image, upsample

RATIO = 4
NIR_MIX = (0.25, 0.55, -0.10)
NIR_OFFSET = 0.10
NIR_TEXTURE = 0.15
PAN_WEIGHTS = (0.25, 0.30, 0.15, 0.30)


@dataclass(frozen=True)
class Scene:
    """One Wald-protocol scene; arrays are float32 H×W×C in [0, 1]."""

    name: str
    ref: np.ndarray     # H×W×4, the original MS (the reference)
    pan: np.ndarray     # H×W×1
    ms_lr: np.ndarray   # H/4×W/4×4, the degraded MS a method receives
    ms_up: np.ndarray   # H×W×4, ms_lr upsampled (bicubic, clipped)

    @property
    def pixels(self) -> int:
        return self.ref.shape[0] * self.ref.shape[1]


def texture(name: str, shape: tuple[int, int]) -> np.ndarray:
    """The fixed NIR texture of an image: smoothed white noise, unit variance, seeded by the name."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    t = gaussian_filter(rng.standard_normal(shape), 1.0)
    return (t / t.std()).astype(np.float32)


def multispectral(rgb: np.ndarray, name: str) -> np.ndarray:
    """R, G, B plus the synthetic NIR band (H×W×4)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    base = NIR_OFFSET + NIR_MIX[0] * r + NIR_MIX[1] * g + NIR_MIX[2] * b
    nir = np.clip(base * (1.0 + NIR_TEXTURE * texture(name, rgb.shape[:2])), 0.0, 1.0)
    return np.concatenate([rgb, nir[..., None]], axis=2).astype(np.float32)


def panchromatic(ms: np.ndarray) -> np.ndarray:
    """PAN = Σ_b w_b·MS_b (H×W×1)."""
    return np.tensordot(ms, np.asarray(PAN_WEIGHTS, np.float32), axes=([2], [0]))[..., None].astype(np.float32)


def _centre_crop(img: np.ndarray, max_side: int) -> np.ndarray:
    h, w = img.shape[:2]
    sh, sw = (min(h, max_side), min(w, max_side)) if max_side > 0 else (h, w)
    y, x = (h - sh) // 2, (w - sw) // 2
    return img[y:y + sh, x:x + sw]


@functools.lru_cache(maxsize=16)
def scene(name: str, max_side: int = 0) -> Scene:
    """The Wald scene of an offline image (``max_side`` > 0: a centre crop of at most that side)."""
    rgb = _centre_crop(load_image(name), max_side)
    h, w = (rgb.shape[0] // RATIO) * RATIO, (rgb.shape[1] // RATIO) * RATIO
    ref = multispectral(rgb[:h, :w], name)
    ms_lr = downsample(ref, RATIO)
    return Scene(name, ref, panchromatic(ref), ms_lr, upsample(ms_lr, RATIO, "bicubic", clip=True))


def training_crops(names: list[str], size: int, per_image: int, max_side: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Aligned random crops (N×C×size×size) of (upsampled MS, PAN, original MS) from the named images."""
    ms, pan, ref = [], [], []
    for name in names:
        s = scene(name, max_side)
        h, w = s.ref.shape[:2]
        if size > min(h, w):
            raise ValueError(f"crop {size} is larger than image {name} ({h}×{w})")
        ys, xs = rng.integers(0, h - size + 1, per_image), rng.integers(0, w - size + 1, per_image)
        for y, x in zip(ys, xs):
            ms.append(s.ms_up[y:y + size, x:x + size])
            pan.append(s.pan[y:y + size, x:x + size])
            ref.append(s.ref[y:y + size, x:x + size])
    to_chw = lambda a: np.ascontiguousarray(np.stack(a).transpose(0, 3, 1, 2))  # noqa: E731
    return to_chw(ms), to_chw(pan), to_chw(ref)
