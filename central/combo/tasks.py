"""The mini-VTAB suite: six small image tasks built offline, all as (N, 3, 32, 32) float32 images.

Every image is RGB, 32×32, in [0, 1], then mapped by :func:`normalise` to ``(x − 0.5) / 0.25``.

==========  =========================================================================  =======  ==========
task        what                                                                       classes  source
==========  =========================================================================  =======  ==========
digits59    MNIST digits 5–9, randomly scaled and placed (:func:`place`)                 5        natural
parity      parity of scikit-learn's 8×8 digits (upsampled to 28), scaled and placed   2        natural
rotation    MNIST digits 5–9 rotated by 0/90/180/270 degrees, scaled and placed        4        structured
texture     64×64 patches of skimage brick / grass / gravel, halved to 32×32          3        specialised
shapes      the number (1–4) of coloured squares/discs/triangles on a noisy canvas     4        structured
patches     64×64 patches of flower.jpg vs china.jpg, halved to 32×32                 2        natural
==========  =========================================================================  =======  ==========

Digits are not centred: each covers 50–80% of the canvas side at a random place (fixed per image by
``data_seed``).  With centred digits a *random* CNN's features were as good as any trained
backbone's (a linear probe reached the same accuracy on every task), so no backbone choice could
matter; the nuisance scale and position make learned invariances pay, as in natural-image tasks.

Test sets are fixed by ``data_seed``; the training set (``n_train`` examples, VTAB-1k style) is drawn
from the task's training pool by ``train_seed``.  The MNIST 5–9 images are split once (by
``data_seed``) between ``digits59`` and ``rotation``, so no image appears in both; the texture and
patch tasks crop training patches from the left half of each image and test patches from the right
half.  MNIST digits 0–4 and the natural images of :data:`PRETRAIN_IMAGES` are reserved for the
backbones' pretraining (:mod:`central.combo.backbones`) and appear in no task.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from central.image.data import crops, load_image
from envs.datasets import MNIST_MEAN, MNIST_STD, load_digits, load_mnist

SIZE = 32
#: The natural images of the backbones' unlabeled pretraining pool (no task uses them).
PRETRAIN_IMAGES = ("astronaut", "chelsea", "rocket", "hubble_deep_field", "retina", "immunohistochemistry",
                   "motorcycle")
TEXTURES = ("brick", "grass", "gravel")
PATCH_IMAGES = ("flower", "china")
SCALE = (0.5, 0.8)  # digits cover 50–80% of the canvas side, at a random place
MNIST_SPLIT = 1250  # MNIST 5–9 images per MNIST task (2,500 in all, split in two halves)


@dataclass
class TaskData:
    """One task: normalised images and labels of its training and test sets."""

    name: str
    n_classes: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def normalise(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """[0, 1] images → ``(x − 0.5) / 0.25`` as a float32 tensor."""
    x = torch.as_tensor(x, dtype=torch.float32)
    return (x - 0.5) / 0.25


def upsample28(gray: np.ndarray) -> np.ndarray:
    """(N, H, W) grey images → (N, 28, 28) (bilinear), the size of an MNIST digit box."""
    x = torch.from_numpy(np.ascontiguousarray(gray, dtype=np.float32))[:, None]
    return F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)[:, 0].clamp(0, 1).numpy()


def place(gray28: np.ndarray | torch.Tensor, rng: np.random.Generator | torch.Generator,
          scale: tuple[float, float] = SCALE) -> torch.Tensor:
    """(N, 28, 28) grey digits in [0, 1] → (N, 3, 32, 32): each shrunk by a random factor and put at a random place.

    The factor s (of the 32-pixel canvas) is uniform in ``scale`` and the centre uniform over the
    positions that keep the whole 32·s box inside the canvas (``torch.nn.functional.affine_grid``,
    bilinear, zero background).  ``rng`` is a numpy Generator (fixed task images) or a torch Generator
    (fresh augmentation in pretraining).
    """
    x = torch.as_tensor(np.asarray(gray28, dtype=np.float32) if isinstance(gray28, np.ndarray) else gray28)
    x = F.pad(x[:, None], (2, 2, 2, 2))
    n = len(x)
    if isinstance(rng, torch.Generator):
        u = torch.rand(n, 3, generator=rng)
    else:
        u = torch.from_numpy(rng.uniform(0.0, 1.0, (n, 3)).astype(np.float32))
    s = scale[0] + (scale[1] - scale[0]) * u[:, 0]
    c = (2 * u[:, 1:] - 1) * (1 - s)[:, None]
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1 / s
    theta[:, :, 2] = -c / s[:, None]
    grid = F.affine_grid(theta, [n, 1, SIZE, SIZE], align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.repeat(1, 3, 1, 1).clamp(0, 1)


def halve(patches: np.ndarray) -> np.ndarray:
    """(N, 64, 64[, 3]) patches → (N, 3, 32, 32) by 2×2 average pooling (grey patches get 3 channels)."""
    x = torch.from_numpy(np.ascontiguousarray(patches, dtype=np.float32))
    x = x[:, None] if x.ndim == 3 else x.permute(0, 3, 1, 2)
    x = F.avg_pool2d(x, 2)
    return (x.repeat(1, 3, 1, 1) if x.shape[1] == 1 else x).numpy()


# -- raw sources -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def mnist_unit() -> tuple[np.ndarray, np.ndarray]:
    """Offline MNIST (5,000 images) back in [0, 1], (N, 28, 28), and its labels."""
    data = load_mnist(None, 0)
    x = (data.x[:, 0] * np.float32(MNIST_STD) + np.float32(MNIST_MEAN)).clip(0, 1)
    return x, data.y


def mnist_high_halves(data_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The MNIST 5–9 row indices split (by ``data_seed``) into the ``digits59`` and ``rotation`` halves."""
    _, y = mnist_unit()
    rows = np.flatnonzero(y >= 5)
    rows = rows[np.random.default_rng(data_seed).permutation(len(rows))]
    return rows[:MNIST_SPLIT], rows[MNIST_SPLIT:2 * MNIST_SPLIT]


def _split_rows(n: int, n_test: int, n_train: int, data_seed: int, train_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed test rows (``data_seed``) and ``n_train`` rows drawn from the rest (``train_seed``)."""
    order = np.random.default_rng(data_seed).permutation(n)
    test, pool = order[:n_test], order[n_test:]
    train = pool[np.random.default_rng(train_seed).permutation(len(pool))[:n_train]]
    return train, test


def _from_arrays(name: str, n_classes: int, x: np.ndarray | torch.Tensor, y: np.ndarray, n_train: int, n_test: int,
                 data_seed: int, train_seed: int) -> TaskData:
    train, test = _split_rows(len(y), n_test, n_train, data_seed, train_seed)
    return TaskData(name, n_classes, normalise(x[train]), torch.as_tensor(y[train]), normalise(x[test]),
                    torch.as_tensor(y[test]))


# -- the six tasks ---------------------------------------------------------------------------------

def digits59(n_train: int, n_test: int, data_seed: int, train_seed: int) -> TaskData:
    x, y = mnist_unit()
    rows = mnist_high_halves(data_seed)[0]
    placed = place(x[rows], np.random.default_rng([data_seed, 6]))
    return _from_arrays("digits59", 5, placed, y[rows] - 5, n_train, n_test, data_seed, train_seed)


def parity(n_train: int, n_test: int, data_seed: int, train_seed: int) -> TaskData:
    data = load_digits(None, 0)
    placed = place(upsample28(data.x[:, 0]), np.random.default_rng([data_seed, 7]))
    return _from_arrays("parity", 2, placed, data.y % 2, n_train, n_test, data_seed, train_seed)


def rotation(n_train: int, n_test: int, data_seed: int, train_seed: int) -> TaskData:
    x, _ = mnist_unit()
    rows = mnist_high_halves(data_seed)[1]
    k = np.arange(len(rows)) % 4  # balanced angles, then shuffled with the rows
    k = k[np.random.default_rng([data_seed, 4]).permutation(len(k))]
    rotated = np.stack([np.rot90(img, int(q)) for img, q in zip(x[rows], k)])
    placed = place(rotated, np.random.default_rng([data_seed, 8]))
    return _from_arrays("rotation", 4, placed, k, n_train, n_test, data_seed, train_seed)


def _crop_task(name: str, images: list[np.ndarray], n_train: int, n_test: int, data_seed: int,
               train_seed: int) -> TaskData:
    """Balanced 64×64 patches: training ones from each image's left half, test ones from its right half."""
    def draw(n: int, side: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        per = np.bincount(np.arange(n) % len(images), minlength=len(images))
        xs, ys = [], []
        for label, (img, m) in enumerate(zip(images, per)):
            half = img.shape[1] // 2
            region = img[:, :half] if side == "left" else img[:, half:]
            xs.append(halve(crops(region, 64, int(m), rng)))
            ys.append(np.full(int(m), label))
        x, y = np.concatenate(xs), np.concatenate(ys)
        order = rng.permutation(n)
        return x[order], y[order]

    x_tr, y_tr = draw(n_train, "left", np.random.default_rng([train_seed, 1]))
    x_te, y_te = draw(n_test, "right", np.random.default_rng([data_seed, 2]))
    return TaskData(name, len(images), normalise(x_tr), torch.as_tensor(y_tr), normalise(x_te), torch.as_tensor(y_te))


@functools.lru_cache(maxsize=1)
def _textures() -> tuple[np.ndarray, ...]:
    import skimage.data

    return tuple(np.asarray(getattr(skimage.data, n)(), dtype=np.float32) / np.float32(255.0) for n in TEXTURES)


def texture(n_train: int, n_test: int, data_seed: int, train_seed: int) -> TaskData:
    return _crop_task("texture", list(_textures()), n_train, n_test, data_seed, train_seed)


def patches(n_train: int, n_test: int, data_seed: int, train_seed: int) -> TaskData:
    return _crop_task("patches", [load_image(n) for n in PATCH_IMAGES], n_train, n_test, data_seed, train_seed)


def render_shapes(counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(N, 3, 32, 32) canvases in [0, 1] with ``counts[i]`` non-overlapping coloured shapes on grey noise."""
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    out = np.empty((len(counts), 3, SIZE, SIZE), np.float32)
    for i, count in enumerate(counts):
        canvas = np.repeat(rng.uniform(0.0, 0.25, (1, SIZE, SIZE)).astype(np.float32), 3, axis=0)
        centres: list[tuple[float, float, float]] = []
        while len(centres) < count:
            r = rng.uniform(2.5, 4.5)
            cy, cx = rng.uniform(r + 1, SIZE - r - 1, 2)
            if any((cy - y) ** 2 + (cx - x) ** 2 < (r + q + 2) ** 2 for y, x, q in centres):
                continue
            centres.append((cy, cx, r))
            kind = rng.integers(3)
            if kind == 0:
                mask = (np.abs(yy - cy) <= r) & (np.abs(xx - cx) <= r)
            elif kind == 1:
                mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            else:
                mask = (yy >= cy - r) & (yy <= cy + r) & (np.abs(xx - cx) <= (yy - (cy - r)) / 2)
            colour = rng.uniform(0.0, 1.0, 3)
            colour[rng.integers(3)] = 1.0  # a saturated channel, so the shape stands out of the noise
            canvas[:, mask] = colour[:, None]
        out[i] = canvas
    return out


def shapes(n_train: int, n_test: int, data_seed: int, train_seed: int) -> TaskData:
    def draw(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        y = rng.permutation(np.arange(n) % 4)
        return render_shapes(y + 1, rng), y

    x_tr, y_tr = draw(n_train, np.random.default_rng([train_seed, 3]))
    x_te, y_te = draw(n_test, np.random.default_rng([data_seed, 5]))
    return TaskData("shapes", 4, normalise(x_tr), torch.as_tensor(y_tr), normalise(x_te), torch.as_tensor(y_te))


#: task name -> builder(n_train, n_test, data_seed, train_seed).
TASKS: dict[str, Callable[[int, int, int, int], TaskData]] = {
    "digits59": digits59, "parity": parity, "rotation": rotation, "texture": texture, "shapes": shapes,
    "patches": patches}
#: task name -> the most examples its train + test sets may hold (None: drawn without limit).
POOL_SIZE: dict[str, int | None] = {"digits59": MNIST_SPLIT, "parity": 1797, "rotation": MNIST_SPLIT,
                                    "texture": None, "shapes": None, "patches": None}


def build_task(name: str, n_train: int, n_test: int, data_seed: int, train_seed: int) -> TaskData:
    """The task ``name`` with ``n_train`` training and ``n_test`` test examples."""
    return TASKS[name](n_train, n_test, data_seed, train_seed)
