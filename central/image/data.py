"""Offline RGB images (``skimage.data`` + scikit-learn's sample images), splits and random crops.

Only images stored inside the installed wheels are listed; the pooch-backed ``skimage.data`` images
(lily, skin, eagle, kidney, cells3d) need a download and are excluded.  ``cat`` is the same picture
as ``chelsea`` and ``colorwheel``/``logo`` are synthetic, so they are left out too.  ``motorcycle``
is the left view of ``skimage.data.stereo_motorcycle``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Sequence

import numpy as np

#: Natural RGB images available offline, with their (H, W): astronaut 512², coffee 400×600,
#: chelsea 300×451, rocket 427×640, hubble_deep_field 872×1000, retina 1411², immunohistochemistry
#: 512², motorcycle 500×741, china 427×640, flower 427×640.
IMAGES: tuple[str, ...] = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "retina",
                           "immunohistochemistry", "motorcycle", "china", "flower")


def _skimage(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        return getattr(skimage.data, name)()
    return load


def _motorcycle() -> np.ndarray:
    import skimage.data

    return skimage.data.stereo_motorcycle()[0]


def _sklearn(filename: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from sklearn.datasets import load_sample_image

        return load_sample_image(filename)
    return load


_LOADERS: dict[str, Callable[[], np.ndarray]] = {
    **{n: _skimage(n) for n in ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "retina",
                                "immunohistochemistry")},
    "motorcycle": _motorcycle,
    "china": _sklearn("china.jpg"),
    "flower": _sklearn("flower.jpg"),
}


@functools.lru_cache(maxsize=None)
def _load_cached(name: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = _LOADERS[name]()
    img = np.ascontiguousarray(raw[..., :3], dtype=np.float32) / np.float32(255.0)
    img.setflags(write=False)
    return img


def load_image(name: str) -> np.ndarray:
    """The image ``name`` as a float32 H×W×3 array in [0, 1] (decoded once per process, returned as a copy)."""
    if name not in _LOADERS:
        raise ValueError(f"unknown image {name!r}; offline images: {', '.join(IMAGES)}")
    return _load_cached(name).copy()


def image_shape(name: str) -> tuple[int, int, int]:
    """(H, W, 3) of an image without copying it."""
    if name not in _LOADERS:
        raise ValueError(f"unknown image {name!r}; offline images: {', '.join(IMAGES)}")
    return tuple(_load_cached(name).shape)  # type: ignore[return-value]


def largest_image() -> str:
    """The offline image with the most pixels (``retina``, 1411×1411)."""
    return max(IMAGES, key=lambda n: image_shape(n)[0] * image_shape(n)[1])


def split(names: Sequence[str], heldout: int, seed: int) -> tuple[list[str], list[str]]:
    """Deterministically hold out ``heldout`` of ``names``; both lists keep the input order."""
    names = list(names)
    if len(set(names)) != len(names):
        raise ValueError("split: names must be distinct")
    if not 0 <= heldout <= len(names):
        raise ValueError(f"split: heldout must be in [0, {len(names)}], got {heldout}")
    picked = set(np.random.default_rng(seed).permutation(len(names))[:heldout].tolist())
    train = [n for i, n in enumerate(names) if i not in picked]
    test = [n for i, n in enumerate(names) if i in picked]
    return train, test


def crops(img: np.ndarray, size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random ``size``×``size`` crops of an H×W(×C) image, stacked as n×size×size(×C)."""
    h, w = img.shape[:2]
    if size < 1 or size > min(h, w):
        raise ValueError(f"crops: size must be in [1, {min(h, w)}] for a {h}×{w} image, got {size}")
    ys = rng.integers(0, h - size + 1, n)
    xs = rng.integers(0, w - size + 1, n)
    return np.stack([img[y:y + size, x:x + size] for y, x in zip(ys, xs)]) if n else \
        np.zeros((0, size, size, *img.shape[2:]), img.dtype)
