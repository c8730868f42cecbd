"""The ``panlut`` centralised method: train Pan-LUT and a PNN-style CNN under the Wald protocol and
compare them with Brovey, Gram-Schmidt and bicubic upsampling on quality and CPU cost.

One run:

1. **Data** — aligned training crops (upsampled MS, PAN, original MS) from the training images
   (:mod:`central.panlut.data`); the held-out test images are processed whole.
2. **Training** — Pan-LUT (identity-initialised LUTs) and the PNN-style CNN on the *same* crops and
   batch order, MSE loss (as PNN), Adam, ``steps`` steps each.
3. **Evaluation** — every method on every test image, whole: PSNR, SSIM, SAM (°), ERGAS (ratio 4),
   against the original MS, and ``sam_lit``: SAM over pixels whose reference band mean is ≥ 0.05
   (black backgrounds — retina, astronaut — make per-pixel angles of near-zero vectors dominate SAM);
   outputs clipped to [0, 1].
4. **Cost** — parameters, multiply-adds per pixel (analytic), and CPU throughput (megapixels/s,
   ``threads`` torch threads, after a warm-up) on the largest offline image (``retina``, 1408² after
   cropping to a multiple of 4) processed whole in one forward pass, no tiling.  Every method is
   timed the same way in the same process: ``timing_repeats`` rounds, the methods interleaved
   within a round, and the fastest round kept (the least-disturbed one on a shared machine).

Headline metrics: ``<metric>/<method>`` for each method (``mpix_per_s/<method>`` on the throughput
image; ``mpix_ratio/<method>``: that throughput ÷ the throughput on the smallest test image, 1 for
a per-pixel cost that does not depend on the image size), ``eval/<metric>`` for the first method
of ``methods``, and when both learned methods ran ``claim/psnr_gap_db`` (PNN − Pan-LUT, dB),
``claim/speedup`` (Pan-LUT MP/s ÷ PNN MP/s) and ``claim/ops_ratio`` (PNN ÷ Pan-LUT multiply-adds
per pixel).  Claim verdicts on them are made by ``fedsim reproduce panlut`` (paired seeds,
intervals), not here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from fedsim.contracts.central import CentralContext
from central.image import IMAGES, ergas, image_grid, largest_image, psnr, sam, ssim
from central.image.data import image_shape
from central.panlut.baselines import PNN, brovey, gram_schmidt, pnn_ops_per_pixel, pnn_params
from central.panlut.data import RATIO, Scene, scene, training_crops
from central.panlut.model import PanLUT, panlut_ops_per_pixel, panlut_params
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL
from fedsim.threads import torch_threads

LEARNED = ("panlut", "pnn")
CLASSICAL = ("gs", "brovey")
METHODS = LEARNED + CLASSICAL
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class PanLUTParams:
    methods: list[str] = field(default_factory=lambda: list(METHODS))  # bicubic is always scored too
    test_images: list[str] = field(default_factory=lambda: ["astronaut", "flower", "retina"])
    train_images: list[str] = field(default_factory=list)  # empty: every other offline image
    max_side: int = 0             # 0: whole images; > 0: centre crops of at most this side (tests)
    crop: int = 64                # training crop side (high-resolution pixels)
    crops_per_image: int = 64
    batch: int = 8
    steps: int = 150              # optimiser steps per learned method
    lr_lut: float = 5.0e-3
    lr_cnn: float = 1.0e-3
    pg_dim: int = 9               # PGLUT 5-D, dim^5 cells × 4 outputs
    sd_dim: int = 9               # SDLUT 4-D per channel and rotation
    ao_dim: int = 9               # AOLUT 5-D
    smooth: float = 1.0           # weight of the LUTs' second-difference (curvature) regulariser
    threads: int = 1              # torch threads for training and timing
    throughput_image: str = "largest"  # "largest", an offline image name, or "none"
    timing_repeats: int = 3       # timed rounds per image (methods interleaved); the fastest is kept
    grid_crop: int = 192          # side of the region shown in the image grid
    log_every: int = 20


# -- checks ----------------------------------------------------------------------------------------

def train_names(p: PanLUTParams) -> list[str]:
    return list(p.train_images) or [n for n in IMAGES if n not in p.test_images]


def check(p: PanLUTParams) -> None:
    """One-line ConfigError for bad values (before any MLflow run exists)."""
    bad = [m for m in p.methods if m not in METHODS]
    if not p.methods or bad:
        raise ConfigError(f"params.methods must be a non-empty subset of {list(METHODS)}, got {p.methods}")
    if len(set(p.methods)) != len(p.methods):
        raise ConfigError(f"params.methods has duplicates: {p.methods}")
    for key in ("test_images", "train_images"):
        unknown = [n for n in getattr(p, key) if n not in IMAGES]
        if unknown:
            raise ConfigError(f"params.{key}: unknown images {unknown}; offline images: {', '.join(IMAGES)}")
    if not p.test_images:
        raise ConfigError("params.test_images must name at least one image")
    if set(p.train_images) & set(p.test_images):
        raise ConfigError(f"params.train_images and params.test_images overlap: "
                          f"{sorted(set(p.train_images) & set(p.test_images))}")
    if any(m in LEARNED for m in p.methods) and not train_names(p):
        raise ConfigError("no training images left: shrink params.test_images or set params.train_images")
    for key in ("pg_dim", "sd_dim", "ao_dim"):
        if not 2 <= getattr(p, key) <= 17:
            raise ConfigError(f"params.{key} must be in [2, 17], got {getattr(p, key)}")
    if p.max_side != 0 and p.max_side < 2 * RATIO:
        raise ConfigError(f"params.max_side must be 0 (whole images) or >= {2 * RATIO}, got {p.max_side}")
    if not RATIO <= p.crop <= (p.max_side or 10**9) or p.crop % RATIO:
        raise ConfigError(f"params.crop must be a multiple of {RATIO} in [{RATIO}, max_side], got {p.crop}")
    for key in ("crops_per_image", "batch", "threads", "grid_crop", "log_every", "timing_repeats"):
        if getattr(p, key) < 1:
            raise ConfigError(f"params.{key} must be >= 1, got {getattr(p, key)}")
    if p.steps < 0:
        raise ConfigError(f"params.steps must be >= 0, got {p.steps}")
    if p.smooth < 0:
        raise ConfigError(f"params.smooth must be >= 0, got {p.smooth}")
    if p.lr_lut <= 0 or p.lr_cnn <= 0:
        raise ConfigError(f"params.lr_lut and params.lr_cnn must be > 0, got {p.lr_lut}, {p.lr_cnn}")
    if p.throughput_image not in ("largest", "none", *IMAGES):
        raise ConfigError(f"params.throughput_image must be 'largest', 'none' or an offline image, "
                          f"got {p.throughput_image!r}")
    for name in train_names(p) if any(m in LEARNED for m in p.methods) else []:
        side = min(image_shape(name)[:2]) if not p.max_side else min(p.max_side, *image_shape(name)[:2])
        if p.crop > side // RATIO * RATIO:
            raise ConfigError(f"params.crop={p.crop} is larger than training image {name} ({side} px)")


# -- helpers ---------------------------------------------------------------------------------------

def to_tensor(a: np.ndarray) -> torch.Tensor:
    """H×W×C → 1×C×H×W."""
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))[None]


def to_image(t: torch.Tensor) -> np.ndarray:
    """1×C×H×W → H×W×C, clipped to [0, 1]."""
    return t[0].clamp(0.0, 1.0).permute(1, 2, 0).contiguous().numpy()


def bicubic(ms_up: torch.Tensor, pan: torch.Tensor) -> torch.Tensor:
    """The upsampled MS itself (the floor every method should beat)."""
    return ms_up


def train(model: torch.nn.Module, data: tuple[np.ndarray, np.ndarray, np.ndarray], order: np.ndarray,
          lr: float, name: str, ctx: CentralContext) -> list[dict[str, float]]:
    """Adam on the MSE over the batches ``order`` (steps × batch indices); logs train/mse/<name>."""
    ms, pan, ref = (torch.from_numpy(a) for a in data)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    p: PanLUTParams = ctx.params
    curve, running = [], []
    model.train()
    with ctx.progress(len(order), f"train {name}") as bar:
        for step, idx in enumerate(order, start=1):
            i = torch.from_numpy(idx)
            loss = (model(ms[i], pan[i]) - ref[i]).pow(2).mean()
            if isinstance(model, PanLUT) and p.smooth > 0:
                loss = loss + p.smooth * model.curvature()
            opt.zero_grad()
            loss.backward()
            opt.step()
            running.append(float(loss.detach()))
            if step % p.log_every == 0 or step == len(order):
                value = float(np.mean(running))
                ctx.log_metrics({f"train/mse/{name}": value}, step=step)
                curve.append({"method": name, "step": step, "mse": value})
                running = []
            bar.advance()
    model.eval()
    return curve


def timed_forwards(forwards: dict[str, Forward], s: Scene, repeats: int) -> dict[str, tuple[np.ndarray, float]]:
    """{method: (output image, seconds)}: whole-image forward passes, the fastest of ``repeats``.

    Every method is warmed up, then timed in ``repeats`` rounds with the methods interleaved in
    each round, so a burst of load on a shared machine hits them alike; the minimum over rounds is
    the least-disturbed pass."""
    ms, pan = to_tensor(s.ms_up), to_tensor(s.pan)
    outs: dict[str, np.ndarray] = {}
    best: dict[str, float] = {}
    with torch.inference_mode():
        for fn in forwards.values():
            fn(ms[..., :64, :64], pan[..., :64, :64])         # warm-up (lazy kernels, allocator)
        for r in range(repeats):
            for m, fn in forwards.items():
                start = time.perf_counter()
                out = fn(ms, pan)
                seconds = time.perf_counter() - start
                if r == 0:
                    outs[m] = to_image(out)
                best[m] = min(best.get(m, math.inf), seconds)
    return {m: (outs[m], best[m]) for m in forwards}


#: Reference band mean below which a pixel counts as dark for ``sam_lit``.
DARK = 0.05


def scores(ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
    """PSNR, SSIM, SAM, ERGAS, and SAM over the non-dark pixels (angles of near-black pixels are
    dominated by tiny absolute errors)."""
    lit = ref.mean(axis=-1) >= DARK
    sam_lit = sam(ref[lit][None], out[lit][None]) if lit.any() else float("nan")
    return {"psnr": psnr(ref, out), "ssim": ssim(ref, out), "sam": sam(ref, out), "sam_lit": sam_lit,
            "ergas": ergas(ref, out, RATIO)}


def _centre(img: np.ndarray, side: int) -> np.ndarray:
    h, w = img.shape[:2]
    side = min(side, h, w)
    y, x = (h - side) // 2, (w - side) // 2
    return img[y:y + side, x:x + side]


# -- figures ---------------------------------------------------------------------------------------

def grid_figure(s: Scene, outputs: dict[str, np.ndarray], side: int) -> Any:
    images = [s.pan, s.ms_up] + [outputs[m] for m in outputs if m != "bicubic"] + [s.ref]
    titles = ["PAN", "MS ↑4 (bicubic)"] + [m for m in outputs if m != "bicubic"] + ["reference"]
    return image_grid([_centre(im, side) for im in images], [f"{s.name}: {t}" if i == 0 else t
                                                              for i, t in enumerate(titles)])


def cost_figure(rows: list[dict[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for r in rows:
        for ax, key in ((ax1, "mpix_per_s"), (ax2, "ops_per_px")):
            if r.get(key):
                ax.scatter(r[key], r["psnr"], s=40)
                ax.annotate(r["method"], (r[key], r["psnr"]), textcoords="offset points", xytext=(4, 4))
    ax1.set(xscale="log", xlabel="CPU throughput on the largest image (MP/s)", ylabel="mean PSNR (dB)")
    ax2.set(xscale="log", xlabel="multiply-adds per pixel", ylabel="mean PSNR (dB)")
    fig.suptitle("Pan-sharpening: quality vs cost")
    return fig


def curve_figure(curves: list[dict[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for m in sorted({c["method"] for c in curves}):
        pts = [(c["step"], c["mse"]) for c in curves if c["method"] == m]
        ax.plot(*zip(*pts), label=m)
    ax.set(xlabel="step", ylabel="training MSE", yscale="log", title="Training loss (reduced resolution)")
    ax.legend()
    return fig


# -- the method ------------------------------------------------------------------------------------

def build(p: PanLUTParams, ctx: CentralContext) -> tuple[dict[str, Forward], list[dict[str, Any]]]:
    """The forward functions of the selected methods (learned ones trained); training curves."""
    forwards: dict[str, Forward] = {"bicubic": bicubic}
    learned = [m for m in p.methods if m in LEARNED]
    curves: list[dict[str, Any]] = []
    if learned:
        data = training_crops(train_names(p), p.crop, p.crops_per_image, p.max_side, ctx.rng("crops"))
        order = ctx.rng("batches").integers(0, len(data[0]), size=(p.steps, p.batch))
    for m in p.methods:
        if m == "panlut":
            model: torch.nn.Module = PanLUT(p.pg_dim, p.sd_dim, p.ao_dim)
            curves += train(model, data, order, p.lr_lut, m, ctx)
            forwards[m] = model
        elif m == "pnn":
            with torch.random.fork_rng():
                torch.manual_seed(ctx.seed("pnn-init"))
                model = PNN()
            curves += train(model, data, order, p.lr_cnn, m, ctx)
            forwards[m] = model
        elif m == "gs":
            forwards[m] = gram_schmidt
        else:
            forwards[m] = brovey
    return forwards, curves


def cost_of(method: str, p: PanLUTParams) -> tuple[int, int]:
    """(parameters, multiply-adds per pixel)."""
    if method == "panlut":
        return panlut_params(p.pg_dim, p.sd_dim, p.ao_dim), panlut_ops_per_pixel()
    if method == "pnn":
        return pnn_params(), pnn_ops_per_pixel()
    return 0, {"bicubic": 0, "brovey": 6, "gs": 12}[method]


@CENTRAL.register("panlut", params=PanLUTParams,
                  summary="Pan-LUT (arXiv 2503.23793): learnable 5-D/4-D LUTs for pan-sharpening vs PNN, GS, Brovey")
def run_panlut(ctx: CentralContext) -> dict[str, float]:
    p: PanLUTParams = ctx.params
    with torch_threads(p.threads):
        forwards, curves = build(p, ctx)
        big = largest_image() if p.throughput_image == "largest" else p.throughput_image
        eval_names = list(p.test_images) + ([big] if big != "none" and big not in p.test_images else [])
        rows: list[dict[str, Any]] = []
        first: dict[str, np.ndarray] = {}
        for name in eval_names:
            s = scene(name, p.max_side)
            for m, (out, seconds) in timed_forwards(forwards, s, p.timing_repeats).items():
                row = {"method": m, "image": name, "test": name in p.test_images, "h": s.ref.shape[0],
                       "w": s.ref.shape[1], "seconds": seconds, "mpix_per_s": s.pixels / 1e6 / seconds,
                       "repeats": p.timing_repeats}
                rows.append({**row, **scores(s.ref, out)})
                if name == p.test_images[0]:
                    first[m] = out
    summary = summarise(rows, forwards, big, p)
    ctx.log_table(rows, "per_image")
    ctx.log_table(summary, "claim")
    if curves:
        ctx.log_table(curves, "training_curves")
        ctx.log_figure(curve_figure(curves), "training_loss")
    ctx.log_figure(grid_figure(scene(p.test_images[0], p.max_side), first, p.grid_crop), "image_grid")
    ctx.log_figure(cost_figure(summary), "quality_vs_cost")
    return headline(summary, p)


def summarise(rows: list[dict[str, Any]], forwards: dict[str, Forward], big: str,
              p: PanLUTParams) -> list[dict[str, Any]]:
    """One row per method: mean quality over the test images, cost, throughput on ``big``."""
    out = []
    for m in forwards:
        test = [r for r in rows if r["method"] == m and r["test"]]
        timing = [r for r in rows if r["method"] == m and r["image"] == big]
        params, ops = cost_of(m, p)
        row: dict[str, Any] = {"method": m, "params": params, "ops_per_px": ops}
        for key in ("psnr", "ssim", "sam", "sam_lit", "ergas"):
            row[key] = float(np.mean([r[key] for r in test]))
        if timing and m != "bicubic":            # bicubic is the input itself: nothing to time
            row["throughput_image"] = big
            row["mpix_per_s"] = timing[0]["mpix_per_s"]
            row["seconds"] = timing[0]["seconds"]
            small = min(test, key=lambda r: r["h"] * r["w"])
            if small["image"] != big:              # size dependence of the per-pixel cost
                row["mpix_ratio"] = timing[0]["mpix_per_s"] / small["mpix_per_s"]
        row["threads"] = p.threads
        out.append(row)
    return out


def headline(summary: list[dict[str, Any]], p: PanLUTParams) -> dict[str, float]:
    by = {r["method"]: r for r in summary}
    metrics: dict[str, float] = {}
    for m, r in by.items():
        for key in ("psnr", "ssim", "sam", "sam_lit", "ergas", "mpix_per_s", "mpix_ratio", "params", "ops_per_px"):
            if key in r:
                metrics[f"{key}/{m}"] = float(r[key])
    primary = by[p.methods[0]]
    for key in ("psnr", "ssim", "sam", "sam_lit", "ergas", "mpix_per_s", "params"):
        if key in primary:
            metrics[f"eval/{key}"] = float(primary[key])
    if "panlut" in by and "pnn" in by:
        lut, cnn = by["panlut"], by["pnn"]
        metrics["claim/psnr_gap_db"] = cnn["psnr"] - lut["psnr"]
        metrics["claim/ops_ratio"] = cnn["ops_per_px"] / lut["ops_per_px"]
        if "mpix_per_s" in lut:
            metrics["claim/speedup"] = lut["mpix_per_s"] / cnn["mpix_per_s"]
    return metrics


run_panlut.check = check  # type: ignore[attr-defined]
