"""The ``tensor_compress`` method: compress a small MNIST ResNet's convs at matched ratios, no fine-tuning.

One run:

1. **Model** — :class:`~central.tensor_compress.model.SmallResNet` trained on a fixed 4,000-image
   MNIST split (cached by spec and seed), scored on the 1,000 held-out images.
2. **Σ** — per compressible conv, the second moment of its input patches on ``sigma_images`` MNIST
   training images (``*_sigma``) and on the ``transfer_source`` images (``*_sigma_transfer``), through
   the original model; eigenvalues floored at ``sigma_floor``·λ_max.
3. **Compression** — for every ratio, every method replaces *all* compressible convs at once by their
   factorised versions with ranks from :mod:`~central.tensor_compress.ratio` (the same per-layer
   budget for Tucker-2 and CP), then the compressed model is scored; BatchNorm statistics are kept,
   nothing is fine-tuned.

Methods: ``tucker_fro`` / ``cp_fro`` (tensorly, Frobenius), ``tucker_id`` / ``cp_id`` (our ALS with
Σ = I — the same objective, a check of the ALS), ``tucker_sigma`` / ``cp_sigma`` (ALS-Σ with Σ from
MNIST), ``tucker_sigma_transfer`` / ``cp_sigma_transfer`` (ALS-Σ with Σ from the transfer source).

Headline metrics: ``acc/original``; ``acc/<method>/x<ratio>`` and ``acc_mean/<method>`` (mean over
ratios); ``eval/accuracy`` (the first method at the first ratio — the claim grid's metric);
``claim/<family>_sigma_gain`` (Σ − Frobenius accuracy, mean over ratios) and
``claim/<family>_transfer_drop`` (Σ − transferred-Σ accuracy) when both sides ran;
``fit/rel_fro_err`` and ``fit/rel_sigma_err`` (the first fit's mean relative error over layers in
each norm; ``fit/<err>/<method>`` averaged over ratios): each fit must be best in its own norm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsim.contracts.central import CentralContext
from central.tensor_compress import ratio as R
from central.tensor_compress.als import DT, cp_als_sigma, sigma_error, to_matrix, tucker2_als_sigma
from central.tensor_compress.baselines import cp_frobenius, tucker2_frobenius
from central.tensor_compress.model import (SOURCES, CPConv, ResNetSpec, Tucker2Conv, accuracy, batches,
                                           compressible_convs, load_or_train, mnist_split, model_key, replace_modules,
                                           source_images, weight_params)
from central.tensor_compress.sigma import effective_rank, estimate_sigmas, floor_psd
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL
from fedsim.threads import torch_threads

FAMILIES = ("tucker", "cp")
VARIANTS = ("fro", "id", "sigma", "sigma_transfer")
METHODS = tuple(f"{f}_{v}" for f in FAMILIES for v in VARIANTS)
MNIST_IMAGES = 5000
_SIGMAS: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}  # raw Σ per (model, source, images, seed)


@dataclass
class TensorCompressParams:
    methods: list[str] = field(default_factory=lambda: [m for m in METHODS if m != "cp_id"])  # cp_id: slow check
    ratios: list[float] = field(default_factory=lambda: [2.0, 3.0, 4.0])  # per-layer compression targets (> 1)
    transfer_source: str = "digits"  # Σ for *_sigma_transfer: digits | noise | mnist
    width: int = 8                 # channels of the first stage (w, 2w, 4w)
    blocks: int = 1                # BasicBlocks per stage
    epochs: int = 6
    n_train: int = 4000
    n_test: int = 1000
    batch: int = 32
    lr: float = 3e-3
    sigma_images: int = 500        # images per Σ source
    sigma_floor: float = 1e-6      # eigenvalue floor, relative to λ_max
    n_iter_max: int = 50           # ALS sweeps (all methods)
    tol: float = 1e-6              # stop when the relative error decreases by less
    dense_max: int = 2500          # Kronecker-structured updates with at most this many unknowns: dense solve
    cg_rtol: float = 1e-10         # ... else conjugate gradients to this relative residual
    cg_max_iter: int = 500
    threads: int = 1               # torch intra-op threads (0 = leave torch's setting)


def check(p: TensorCompressParams) -> None:
    """One-line ConfigError for bad values (before any MLflow run exists)."""
    bad = [m for m in p.methods if m not in METHODS]
    if not p.methods or bad:
        raise ConfigError(f"params.methods must be a non-empty subset of {list(METHODS)}, got {list(p.methods)}")
    if len(set(p.methods)) != len(p.methods):
        raise ConfigError(f"params.methods has duplicates: {list(p.methods)}")
    if not p.ratios or any(not np.isfinite(r) or r <= 1 for r in p.ratios):
        raise ConfigError(f"params.ratios must be a non-empty list of compression ratios > 1, got {list(p.ratios)}")
    if len(set(p.ratios)) != len(p.ratios):
        raise ConfigError(f"params.ratios has duplicates: {list(p.ratios)}")
    if p.transfer_source not in SOURCES:
        raise ConfigError(f"params.transfer_source must be one of {list(SOURCES)}, got {p.transfer_source!r}")
    for key in ("width", "blocks", "batch", "sigma_images", "n_iter_max", "cg_max_iter", "n_test", "dense_max"):
        if getattr(p, key) < 1:
            raise ConfigError(f"params.{key} must be >= 1, got {getattr(p, key)}")
    if p.width < 2:
        raise ConfigError(f"params.width must be >= 2 (Tucker-2 needs more than one input channel), got {p.width}")
    if p.epochs < 0 or p.threads < 0:
        raise ConfigError(f"params.epochs and params.threads must be >= 0, got {p.epochs}, {p.threads}")
    if p.n_train < 10 or p.n_train + p.n_test > MNIST_IMAGES:
        raise ConfigError(f"params.n_train must be >= 10 and n_train + n_test <= {MNIST_IMAGES}, "
                          f"got {p.n_train} + {p.n_test}")
    if p.sigma_images > p.n_train:
        raise ConfigError(f"params.sigma_images ({p.sigma_images}) must be <= params.n_train ({p.n_train})")
    if not 0 < p.sigma_floor < 1:
        raise ConfigError(f"params.sigma_floor must be in (0, 1), got {p.sigma_floor}")
    if p.lr <= 0 or p.tol < 0 or p.cg_rtol <= 0:
        raise ConfigError(f"params.lr and params.cg_rtol must be > 0 and params.tol >= 0, "
                          f"got {p.lr}, {p.cg_rtol}, {p.tol}")


# -- one decomposition -----------------------------------------------------------------------------

def sigma_source(method: str) -> str | None:
    """Which Σ a method uses: "target" (MNIST), "transfer", or None (Frobenius / Σ = I)."""
    if method.endswith("_sigma_transfer"):
        return "transfer"
    return "target" if method.endswith("_sigma") else None


def decompose(method: str, conv: nn.Conv2d, ratio: float, sigma: torch.Tensor | None, p: TensorCompressParams,
              seed: int) -> tuple[nn.Module, dict[str, Any], torch.Tensor]:
    """(factorised module, per-layer facts, reconstructed kernel) of one conv by one method."""
    w = conv.weight.detach()
    c_out, c_in, kh, kw = w.shape
    k2 = kh * kw
    opts = dict(n_iter_max=p.n_iter_max, tol=p.tol)
    cg = dict(cg_rtol=p.cg_rtol, cg_max_iter=p.cg_max_iter, dense_max=p.dense_max)
    if method.startswith("tucker"):
        r_in, r_out = R.tucker2_ranks(c_in, c_out, k2, ratio)
        if method == "tucker_fro":
            t, trace = tucker2_frobenius(w, r_in, r_out, **opts)
        else:
            t, trace = tucker2_als_sigma(w, r_in, r_out, sigma, **opts, **cg)
        module, params, ranks = Tucker2Conv(conv, t), R.tucker2_params(c_in, c_out, k2, r_in, r_out), f"{r_in},{r_out}"
    else:
        rank = R.cp_rank(c_in, c_out, k2, ratio)
        if method == "cp_fro":
            t, trace = cp_frobenius(w, rank, **opts, seed=seed)
        else:
            t, trace = cp_als_sigma(w, rank, sigma, **opts, seed=seed, **cg)
        module, params, ranks = CPConv(conv, t), R.cp_params(c_in, c_out, k2, rank), str(rank)
    facts = {"ranks": ranks, "params": params, "original_params": R.conv_params(c_in, c_out, k2),
             "sweeps": trace.sweeps, "converged": trace.converged, "reverted": trace.reverted}
    return module, facts, t.kernel((kh, kw))


# -- the run ---------------------------------------------------------------------------------------

@CENTRAL.register("tensor_compress", params=TensorCompressParams,
                  summary="Distribution-aware Tucker-2/CP compression of conv kernels "
                          "(ALS in the Σ-norm, arXiv 2511.04494)")
def run_tensor_compress(ctx: CentralContext) -> dict[str, float]:
    p: TensorCompressParams = ctx.params
    with torch_threads(p.threads):
        return _run(ctx, p)


def _run(ctx: CentralContext, p: TensorCompressParams) -> dict[str, float]:
    (x_tr, y_tr), (x_te, y_te) = mnist_split(p.n_train, p.n_test)
    spec = ResNetSpec(p.width, p.blocks, p.n_train, p.epochs, p.batch, p.lr, ctx.seed("model"))
    start = time.perf_counter()
    model, cached = load_or_train(spec, x_tr, y_tr)
    base_acc = accuracy(model, x_te, y_te)
    ctx.log_params({"model/params": weight_params(model), "model/cached": cached})
    ctx.log_metrics({"acc/original": base_acc, "time/train_s": time.perf_counter() - start}, step=0)
    names = compressible_convs(model)
    convs = {n: model.get_submodule(n) for n in names}
    sigmas, sigma_rows = _sigmas(ctx, p, model, model_key(spec), names, x_tr)

    rows, layer_rows, headline = [], [], {"acc/original": base_acc}
    with ctx.progress(len(p.ratios) * len(p.methods), "tensor_compress") as bar:
        for step, ratio in enumerate(p.ratios, 1):
            for method in p.methods:
                t0 = time.perf_counter()
                new, facts = {}, []
                for name in names:
                    src = sigma_source(method)
                    sigma = sigmas[src][name] if src else None
                    module, f, kernel = decompose(method, convs[name], ratio, sigma, p, ctx.seed("cp-init", name))
                    new[name] = module
                    f.update(_errors(convs[name], kernel, sigmas["target"][name] if "target" in sigmas else None))
                    facts.append({"method": method, "ratio": ratio, "layer": name, **f})
                acc = accuracy(replace_modules(model, new), x_te, y_te)
                seconds = time.perf_counter() - t0
                kept = sum(f["params"] for f in facts)
                orig = sum(f["original_params"] for f in facts)
                rows.append({"method": method, "ratio": ratio, "achieved_ratio": round(orig / kept, 3),
                             "factorised_params": kept, "original_params": orig, "accuracy": acc,
                             "acc_drop": round(base_acc - acc, 4), "seconds": round(seconds, 2),
                             **{k: float(np.mean([f[k] for f in facts])) for k in ERRORS if k in facts[0]}})
                layer_rows.extend(facts)
                label = f"{method}/x{ratio:g}"
                headline[f"acc/{label}"] = acc
                ctx.log_metrics({f"acc/{method}": acc, f"time/{method}_s": seconds}, step=step)
                bar.advance()
    headline.update(_summary(p, rows))
    _plots(ctx, p, rows, layer_rows, base_acc)
    ctx.log_table(rows, "accuracy")
    ctx.log_table([{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()} for r in layer_rows],
                  "layers")
    ctx.log_table(sigma_rows, "sigma")
    return headline


def _sigmas(ctx: CentralContext, p: TensorCompressParams, model: nn.Module, key: str, names: list[str],
            x_tr: torch.Tensor) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """Floored Σ per layer for the MNIST target (always, for the Σ-error columns) and the transfer source."""
    wanted = {"target": "mnist"}
    if any(sigma_source(m) == "transfer" for m in p.methods):
        wanted["transfer"] = p.transfer_source
    out: dict[str, dict[str, torch.Tensor]] = {}
    raw: dict[str, dict[str, torch.Tensor]] = {}
    for role, source in wanted.items():
        cache_key = (key, source, p.sigma_images, ctx.seed("sigma", source))
        if cache_key not in _SIGMAS:  # claim checks rerun the same model and source in one process
            images = source_images(source, x_tr, p.sigma_images, ctx.generator("sigma", source))
            _SIGMAS[cache_key] = estimate_sigmas(model, names, batches(images, 100))
        raw[role] = _SIGMAS[cache_key]
        out[role] = {n: floor_psd(s, p.sigma_floor)[0] for n, s in raw[role].items()}
    rows = []
    for n in names:
        target = raw["target"][n]
        row = {"layer": n, "dim": target.shape[0], "eff_rank/mnist": round(effective_rank(target), 2),
               "trace/mnist": round(float(target.trace()), 4)}
        if "transfer" in raw:
            other = raw["transfer"][n]
            row[f"eff_rank/{p.transfer_source}"] = round(effective_rank(other), 2)
            row[f"trace/{p.transfer_source}"] = round(float(other.trace()), 4)
            row["rel_diff"] = round(float((other - target).norm() / target.norm()), 4)
        rows.append(row)
    return out, rows


def _errors(conv: nn.Conv2d, kernel: torch.Tensor, sigma: torch.Tensor | None) -> dict[str, float]:
    """Relative Frobenius and (MNIST) Σ errors of a reconstructed kernel."""
    w, w_hat = to_matrix(conv.weight), to_matrix(kernel)
    out = {"rel_fro_err": sigma_error(w, w_hat, torch.eye(w.shape[0], dtype=DT))}
    if sigma is not None:
        out["rel_sigma_err"] = sigma_error(w, w_hat, sigma)
    return out


#: per-layer relative reconstruction errors (Frobenius; Σ from MNIST), averaged over layers per fit
ERRORS = ("rel_fro_err", "rel_sigma_err")


def _summary(p: TensorCompressParams, rows: list[dict[str, Any]]) -> dict[str, float]:
    acc = {(r["method"], r["ratio"]): r["accuracy"] for r in rows}
    out = {f"acc_mean/{m}": float(np.mean([acc[(m, r)] for r in p.ratios])) for m in p.methods}
    out["eval/accuracy"] = acc[(p.methods[0], p.ratios[0])]
    first = next(r for r in rows if (r["method"], r["ratio"]) == (p.methods[0], p.ratios[0]))
    for key in ERRORS:  # the first fit's mean relative error over layers, in each norm (the controls' metric)
        if key in first:
            out[f"fit/{key}"] = first[key]
            for m in p.methods:
                out[f"fit/{key}/{m}"] = float(np.mean([r[key] for r in rows if r["method"] == m]))
    for fam in FAMILIES:
        pairs = {"sigma_gain": (f"{fam}_sigma", f"{fam}_fro"),
                 "transfer_drop": (f"{fam}_sigma", f"{fam}_sigma_transfer"),
                 "transfer_gain": (f"{fam}_sigma_transfer", f"{fam}_fro")}
        for key, (a, b) in pairs.items():
            if a in p.methods and b in p.methods:
                out[f"claim/{fam}_{key}"] = float(np.mean([acc[(a, r)] - acc[(b, r)] for r in p.ratios]))
    return out


def _plots(ctx: CentralContext, p: TensorCompressParams, rows: list[dict[str, Any]],
           layer_rows: list[dict[str, Any]], base_acc: float) -> None:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    styles = {"fro": ("o", "-"), "id": ("x", ":"), "sigma": ("s", "-"), "sigma_transfer": ("^", "--")}
    colours = {"tucker": "tab:blue", "cp": "tab:red"}

    def style(m: str) -> dict[str, Any]:
        fam, var = m.split("_", 1)
        marker, line = styles[var]
        return {"marker": marker, "linestyle": line, "color": colours[fam], "alpha": 0.6 if var == "id" else 1.0}

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m in p.methods:
        pts = sorted((r["achieved_ratio"], r["accuracy"]) for r in rows if r["method"] == m)
        ax.plot(*zip(*pts), label=m, **style(m))
    ax.axhline(base_acc, color="k", linewidth=0.8, label="uncompressed")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compression ratio of the compressed convs (achieved)")
    ax.set_ylabel("test accuracy, no fine-tuning")
    ax.set_title(f"SmallResNet-w{p.width} on MNIST; transfer Σ from {p.transfer_source}")
    ax.legend(fontsize=7, ncol=2)
    ctx.log_figure(fig, "accuracy_vs_ratio")

    if any("rel_sigma_err" in r for r in layer_rows):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, key in zip(axes, ("rel_sigma_err", "rel_fro_err")):
            for m in p.methods:
                pts = [(r["ratio"], float(np.mean([x[key] for x in layer_rows
                                                   if x["method"] == m and x["ratio"] == r["ratio"]])))
                       for r in rows if r["method"] == m]
                ax.plot(*zip(*pts), label=m, **style(m))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("target compression ratio")
            ax.set_ylabel(f"{key} (mean over layers)")
        axes[0].set_title("error in the MNIST Σ-norm")
        axes[1].set_title("error in the Frobenius norm")
        axes[1].legend(fontsize=7)
        ctx.log_figure(fig, "kernel_errors")


run_tensor_compress.check = check  # type: ignore[attr-defined]
