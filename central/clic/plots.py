"""Figures of the ``clic`` run: sample images with captions and negatives, and the variant comparison."""

from __future__ import annotations

import textwrap
from typing import Any

from fedsim.mpl import use_agg

use_agg()
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from central.clic.negatives import EVAL_TYPES  # noqa: E402


def _show(ax: Any, image: torch.Tensor, text: str, width: int = 34) -> None:
    ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title("\n".join(textwrap.wrap(text, width)), fontsize=6, loc="left")


def plot_samples(eval_images: torch.Tensor, examples: list[dict[str, str]], clic_images: torch.Tensor,
                 clic_texts: dict[str, list[str]]) -> Any:
    """Top: held-out images with p1, the paraphrase p2 and two of their negatives.  Bottom: CLIC
    training images (a pair stacked) with p1, p2 and the swapped hard negative."""
    n = min(4, len(examples), len(clic_images))
    fig, axes = plt.subplots(2, n, figsize=(2.6 * n, 6.4), squeeze=False)
    for i in range(n):
        ex = examples[i]
        _show(axes[0, i], eval_images[i], f"p1: {ex['p1']}\np2: {ex['p2']}\nswap_att: {ex['swap_att']}\n"
                                          f"replace_rel: {ex['replace_rel']}")
        _show(axes[1, i], clic_images[i], f"p1: {clic_texts['p1'][i]}\np2: {clic_texts['p2'][i]}\n"
                                          f"neg: {clic_texts['negative'][i]}", width=40)
    axes[0, 0].set_ylabel("evaluation triplets", fontsize=8)
    axes[1, 0].set_ylabel("CLIC training pairs", fontsize=8)
    fig.tight_layout()
    return fig


def plot_variants(results: dict[str, dict[str, float]]) -> Any:
    """Grouped bars: ITT, TOT, R@1 image→text, R@1 text→image for the pretrained model and each variant."""
    keys = [("itt_acc", "ITT"), ("tot_acc", "TOT"), ("r1_i2t", "R@1 i→t"), ("r1_t2i", "R@1 t→i")]
    names = list(results)
    x = np.arange(len(keys))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for j, name in enumerate(names):
        vals = [results[name][k] for k, _ in keys]
        bars = ax.bar(x + (j - (len(names) - 1) / 2) * width, vals, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.set_xticks(x, [label for _, label in keys])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy / recall")
    ax.set_title("SugarCrepe++-style compositionality and retrieval (held-out scenes)")
    ax.legend(fontsize=7, ncol=len(names))
    fig.tight_layout()
    return fig


def plot_per_type(results: dict[str, dict[str, float]]) -> Any:
    """ITT (left) and TOT (right) per negative type and model."""
    names = list(results)
    x = np.arange(len(EVAL_TYPES))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, task in zip(axes, ("itt", "tot")):
        for j, name in enumerate(names):
            ax.bar(x + (j - (len(names) - 1) / 2) * width, [results[name][f"{task}/{k}"] for k in EVAL_TYPES],
                   width, label=name)
        ax.set_xticks(x, list(EVAL_TYPES), fontsize=7)
        ax.set_title(task.upper())
        ax.set_ylim(0, 1.05)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_losses(curves: dict[str, list[tuple[int, float]]], smooth: int = 10) -> Any:
    """Fine-tuning loss per variant and step kind (CLIC's concatenated steps and its CLIP steps apart)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, points in curves.items():
        steps, values = np.array(points).T
        k = min(smooth, len(values))
        ax.plot(steps[k - 1:], np.convolve(values, np.ones(k) / k, mode="valid"), label=name)
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel(f"loss (moving mean of {smooth} steps of a kind)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
