"""The synthetic low-light data: kit images at a working resolution, training crops, darkened test sets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from central.image.data import crops, load_image, split
from central.image.degrade import darken


@dataclass(frozen=True)
class DarkRange:
    """Darkening x_low = clip(gain·x^gamma + N(0, noise²)) with each factor uniform in its range."""

    gain: tuple[float, float]
    gamma: tuple[float, float]
    noise: tuple[float, float]

    def draw(self, rng: np.random.Generator) -> tuple[float, float, float]:
        return (float(rng.uniform(*self.gain)), float(rng.uniform(*self.gamma)), float(rng.uniform(*self.noise)))


@dataclass
class TestPair:
    name: str
    clean: np.ndarray  # H×W×3 in [0, 1]
    dark: np.ndarray
    gain: float
    gamma: float
    noise: float


def resize_short_side(img: np.ndarray, short: int) -> np.ndarray:
    """Anti-aliased resize so that min(H, W) = ``short`` (no-op when it already is)."""
    from skimage.transform import resize

    h, w = img.shape[:2]
    if min(h, w) == short:
        return img
    s = short / min(h, w)
    out = resize(img, (round(h * s), round(w * s)), order=3, anti_aliasing=s < 1, preserve_range=True)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def working_images(names: list[str], short: int) -> dict[str, np.ndarray]:
    return {n: resize_short_side(load_image(n), short) for n in names}


def train_test_names(images: list[str], heldout: int, split_seed: int) -> tuple[list[str], list[str]]:
    return split(images, heldout, split_seed)


def training_crops(images: dict[str, np.ndarray], size: int, per_image: int, rng: np.random.Generator) -> torch.Tensor:
    """Random crops of the training images as an N×3×size×size tensor in [0, 1]."""
    stacks = [crops(img, size, per_image, rng) for img in images.values()]
    return torch.from_numpy(np.concatenate(stacks)).permute(0, 3, 1, 2).contiguous()


def darken_batch(clean: torch.Tensor, dark: DarkRange, rng: np.random.Generator) -> torch.Tensor:
    """Darken each image of a B×3×H×W batch with its own (gain, gamma, noise) drawn from ``dark``."""
    out = [darken(img.permute(1, 2, 0).numpy(), *dark.draw(rng), rng) for img in clean]
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous()


def test_pairs(images: dict[str, np.ndarray], dark: DarkRange, draws: int, rng: np.random.Generator) -> list[TestPair]:
    """``draws`` darkenings of every test image."""
    pairs = []
    for name, img in images.items():
        for _ in range(draws):
            gain, gamma, noise = dark.draw(rng)
            pairs.append(TestPair(name, img, darken(img, gain, gamma, noise, rng), gain, gamma, noise))
    return pairs


def to_tensor(img: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).unsqueeze(0).float()


def to_image(x: torch.Tensor) -> np.ndarray:
    return x[0].detach().clamp(0.0, 1.0).permute(1, 2, 0).numpy().astype(np.float32)
