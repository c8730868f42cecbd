"""A side-by-side figure of images (for ``ctx.log_figure``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _displayable(img: np.ndarray) -> tuple[np.ndarray, str | None]:
    """An image matplotlib can show: RGB from the first 3 bands, or one band in grey."""
    a = np.clip(np.asarray(img, dtype=np.float32), 0.0, 1.0)
    if a.ndim == 3 and a.shape[2] >= 3:
        return a[..., :3], None
    if a.ndim == 3:
        return a[..., 0], "gray"
    return a, "gray"


def image_grid(images: list[np.ndarray], titles: list[str], rows: int | None = None,
               panel_inches: float = 3.0) -> Any:
    """A matplotlib Figure with the images side by side (rows × ⌈n/rows⌉ panels, values clipped to
    [0, 1]; 1-band and 2-band images in grey, ≥3 bands as RGB of the first three)."""
    from matplotlib.figure import Figure

    if len(images) != len(titles):
        raise ValueError(f"image_grid: {len(images)} images but {len(titles)} titles")
    if not images:
        raise ValueError("image_grid: no images")
    n = len(images)
    rows = rows or max(1, math.ceil(n / 5))
    cols = math.ceil(n / rows)
    fig = Figure(figsize=(panel_inches * cols, panel_inches * rows + 0.3), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, img, title in zip(axes, images, titles):
        shown, cmap = _displayable(img)
        ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(title, fontsize=9)
    for ax in axes:
        ax.set_axis_off()
    return fig
