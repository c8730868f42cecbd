"""The ParetoQ sweep on the kit's tiny Llama: bits × QAT fraction (× width) at a fixed step budget."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from transformers import LlamaForCausalLM

from fedsim.contracts.central import CentralContext
from central.lm import tiny
from central.paretoq.quant import (BIT_WIDTHS, TERNARY, ByteCount, bits_label, block_numel, block_weights,
                                   canonical_bits, model_bytes, quantize_model, relative_change)
from fedsim.errors import ConfigError
from fedsim.threads import torch_threads
from fedsim.registry import CENTRAL


@dataclass
class ParetoQParams:
    preset: str = "drafter"  # tiny-LM preset: "drafter" (quick run, claim check), "target", "test" (tests)
    widths: list[int] = field(default_factory=list)  # d_model values (d_ff scales with it); [] = the preset's
    n_layers: int = 0  # 0 = the preset's
    batch_size: int = 0  # 0 = the preset's
    seq_len: int = 0  # 0 = the preset's
    corpus_chars: int = 0  # training text; 0 = the preset's
    budget_steps: int = 200  # total training budget B: (1-f)·B full-precision steps, then f·B QAT steps
    bits: list[float] = field(default_factory=lambda: [1.0, 1.58, 2.0, 3.0, 4.0])
    fractions: list[float] = field(default_factory=lambda: [0.0, 0.1, 0.5])  # QAT fraction f
    seq_bits: list[float] = field(default_factory=lambda: [1.58, 2.0])  # bit widths quantised with SEQ (else LSQ)
    qat_lr: float = 1e-3  # QAT fine-tuning learning rate (cosine to 0, no warm-up, no weight decay)
    eval_chars: int = 200_000  # held-out text for the loss
    eval_windows: int = 32  # held-out windows of seq_len tokens
    fp_bits: int = 16  # storage of the full-precision rest (embeddings, norms) and of the scales
    threads: int = 1  # torch intra-op threads during the sweep (0 = leave torch's); tiny matmuls run best on 1


@dataclass
class Point:
    """One trained model of the sweep (bits=16.0 marks the full-precision model of the FP phase)."""

    width: int
    bits: float
    fraction: float
    fp_steps: int
    qat_steps: int
    loss: float
    bytes: ByteCount
    linear_bytes: int = 0  # the block linears alone: packed weights + scales (16-bit weights for the FP model)
    change_latent: float = float("nan")
    change_quantized: float = float("nan")
    seconds: float = 0.0

    @property
    def quantized(self) -> bool:
        return self.bits != 16.0

    def size(self, axis: str) -> int:
        """Bytes on the ``"total"`` (whole model) or ``"linear"`` (quantised block linears) axis."""
        return self.bytes.total if axis == "total" else self.linear_bytes

    def row(self) -> dict[str, object]:
        return {"width": self.width, "bits": bits_label(self.bits) if self.quantized else "16 (fp)",
                "qat_fraction": self.fraction, "fp_steps": self.fp_steps, "qat_steps": self.qat_steps,
                "heldout_loss": round(self.loss, 5), "model_bytes": self.bytes.total,
                "block_linear_bytes": self.linear_bytes,
                "quantized_weight_bytes": self.bytes.quantized_weights, "scale_bytes": self.bytes.scales,
                "fp_bytes": self.bytes.full_precision, "weight_change_latent": round(self.change_latent, 5),
                "weight_change_quantized": round(self.change_quantized, 5), "seconds": round(self.seconds, 1)}


# -- configuration ------------------------------------------------------------------------------


def split_budget(budget: int, fraction: float) -> tuple[int, int]:
    """(full-precision steps, QAT steps) for QAT fraction ``fraction`` of ``budget`` steps."""
    qat = int(round(fraction * budget))
    return budget - qat, qat


def base_spec(p: ParetoQParams) -> tiny.TinyLMSpec:
    """The preset with the params' overrides (its ``steps``/``warmup`` stay: they set the warm-up share)."""
    changes: dict[str, int] = {}
    for key in ("n_layers", "batch_size", "seq_len", "corpus_chars"):
        if getattr(p, key):
            changes[key] = getattr(p, key)
    return tiny.preset(p.preset, **changes)


def widths_of(p: ParetoQParams) -> list[int]:
    return list(p.widths) or [base_spec(p).d_model]


def width_spec(base: tiny.TinyLMSpec, width: int, seed: int) -> tiny.TinyLMSpec:
    """``base`` at model width ``width`` (d_ff scaled in proportion, a multiple of 8) and ``seed``."""
    d_ff = max(8, int(round(base.d_ff * width / base.d_model / 8)) * 8)
    return replace(base, d_model=width, d_ff=d_ff, seed=seed)


def check(p: ParetoQParams) -> None:
    """One-line ConfigErrors for bad values (run before any MLflow run starts)."""
    if p.preset not in tiny.PRESETS:
        raise ConfigError(f"params.preset must be one of {', '.join(tiny.PRESETS)}, got {p.preset!r}")
    if not p.bits:
        raise ConfigError("params.bits must list at least one bit width")
    for b in list(p.bits) + list(p.seq_bits):
        try:
            canonical_bits(b)
        except ValueError:
            raise ConfigError(f"params.bits: {b!r} is not a ParetoQ bit width "
                              f"({', '.join(f'{x:g}' for x in BIT_WIDTHS)})") from None
    if len({canonical_bits(b) for b in p.bits}) != len(p.bits):
        raise ConfigError(f"params.bits has duplicates: {list(p.bits)}")
    if any(canonical_bits(b) not in (TERNARY, 2.0) for b in p.seq_bits):
        raise ConfigError(f"params.seq_bits: SEQ is defined for 1.58 and 2 bits only, got {list(p.seq_bits)}")
    if p.budget_steps < 2:
        raise ConfigError(f"params.budget_steps must be >= 2, got {p.budget_steps}")
    if not p.fractions or len(set(p.fractions)) != len(p.fractions):
        raise ConfigError(f"params.fractions must be a non-empty list without duplicates, got {list(p.fractions)}")
    for f in p.fractions:
        if not 0.0 <= f <= 1.0:
            raise ConfigError(f"params.fractions: the QAT fraction must lie in [0, 1], got {f}")
        fp, qat = split_budget(p.budget_steps, f)
        if (f > 0 and qat == 0) or (f < 1 and fp == 0):
            raise ConfigError(f"params.fractions: {f} of budget_steps={p.budget_steps} rounds to "
                              f"{qat} QAT / {fp} full-precision steps; raise budget_steps")
    for key in ("n_layers", "batch_size", "seq_len", "corpus_chars", "eval_chars"):
        if getattr(p, key) < 0:
            raise ConfigError(f"params.{key} must be >= 0, got {getattr(p, key)}")
    if p.qat_lr <= 0 or p.eval_windows < 1 or p.fp_bits < 1 or p.threads < 0:
        raise ConfigError("params.qat_lr must be > 0, params.eval_windows >= 1, params.fp_bits >= 1 "
                          "and params.threads >= 0")
    heads = base_spec(p).n_heads
    for w in widths_of(p):
        if w < heads or w % heads or (w // heads) % 2:
            raise ConfigError(f"params.widths: {w} must be a multiple of n_heads={heads} with an even head size")


# -- training -----------------------------------------------------------------------------------


def fp_recipe_spec(spec: tiny.TinyLMSpec, steps: int) -> tiny.TinyLMSpec:
    """The kit's pre-training recipe over ``steps`` steps (warm-up kept at the preset's share)."""
    return replace(spec, steps=steps, warmup=max(1, round(steps * spec.warmup / spec.steps)))


def qat_recipe(spec: tiny.TinyLMSpec, qat_lr: float, steps: int, from_scratch: bool) -> tiny.Recipe:
    """Fine-tuning QAT: the authors' recipe shape (AdamW, cosine to 0, no warm-up, no weight decay)
    at ``qat_lr``; QAT from scratch (f = 1) is pre-training, so it takes the kit's pre-training recipe."""
    if from_scratch:
        return tiny.pretrain_recipe(fp_recipe_spec(spec, steps))
    return tiny.Recipe(qat_lr, 0, 0.0, (0.9, 0.999), 0.0)


def train_fp(spec: tiny.TinyLMSpec, ids: torch.Tensor, steps: int) -> LlamaForCausalLM:
    """A fresh model of ``spec`` trained in full precision for ``steps`` steps with the kit's trainer."""
    model = tiny.build(spec)
    if steps > 0:
        tiny.train(model, fp_recipe_spec(spec, steps), ids)
    model.eval()
    return model


def train_qat(model: LlamaForCausalLM, spec: tiny.TinyLMSpec, ids: torch.Tensor, steps: int, recipe: tiny.Recipe,
              gen: torch.Generator) -> list[float]:
    """QAT of every parameter (latent weights, scales, embeddings, norms); scales get no weight decay."""
    scales = [p for n, p in model.named_parameters() if n.endswith("weight_clip_val")]
    others = [p for n, p in model.named_parameters() if not n.endswith("weight_clip_val")]
    groups = [{"params": others, "weight_decay": recipe.weight_decay}, {"params": scales, "weight_decay": 0.0}]
    return tiny.train_steps(model, ids, recipe, steps, spec.batch_size, spec.seq_len, gen, param_groups=groups)


def quantize_and_train(fp_model: LlamaForCausalLM, spec: tiny.TinyLMSpec, ids: torch.Tensor, bits: float,
                       qat_steps: int, from_scratch: bool, p: ParetoQParams, seed: int) -> LlamaForCausalLM:
    """A quantised copy of ``fp_model`` after ``qat_steps`` of QAT (0 steps: post-training quantisation)."""
    model = copy.deepcopy(fp_model)
    quantize_model(model, bits, tuple(p.seq_bits))
    if qat_steps > 0:
        gen = torch.Generator().manual_seed(seed)
        train_qat(model, spec, ids, qat_steps, qat_recipe(spec, p.qat_lr, qat_steps, from_scratch), gen)
    model.eval()
    return model


# -- the sweep ------------------------------------------------------------------------------------


@dataclass
class Data:
    train: torch.Tensor
    heldout: torch.Tensor


def load_data(spec: tiny.TinyLMSpec, eval_chars: int) -> Data:
    tok = tiny.tokenizer_for(spec)
    return Data(tiny.corpus_ids(tok, "train", spec.corpus_chars), tiny.corpus_ids(tok, "heldout", eval_chars))


def sweep(p: ParetoQParams, seed_of: Callable[..., int],
          on_point: Callable[[Point], None] = lambda point: None) -> list[Point]:
    """Every (width, fraction, bits) of ``p``: one FP phase per (width, fraction), one QAT per bits.

    ``seed_of(*stream)`` gives the seeds (a :meth:`CentralContext.seed`); ``on_point`` sees each result.
    """
    base = base_spec(p)
    data = load_data(base, p.eval_chars)
    points: list[Point] = []
    for width in widths_of(p):
        spec = width_spec(base, width, seed_of("model", width) % (2**31))
        for f in p.fractions:
            fp_steps, qat_steps = split_budget(p.budget_steps, f)
            start = time.perf_counter()
            fp_model = train_fp(spec, data.train, fp_steps)
            before = block_weights(fp_model)
            if fp_steps > 0:
                fp_loss = tiny.mean_loss(fp_model, data.heldout, spec.seq_len, p.eval_windows)
                point = Point(width, 16.0, f, fp_steps, 0, fp_loss, model_bytes(fp_model, p.fp_bits, p.fp_bits),
                              linear_bytes=math.ceil(block_numel(fp_model) * p.fp_bits / 8), change_latent=0.0,
                              change_quantized=0.0, seconds=time.perf_counter() - start)
                points.append(point)
                on_point(point)
            for bits in p.bits:
                start = time.perf_counter()
                model = quantize_and_train(fp_model, spec, data.train, bits, qat_steps, fp_steps == 0, p,
                                           seed_of("qat", width, f, bits_label(bits)) % (2**31))
                loss = tiny.mean_loss(model, data.heldout, spec.seq_len, p.eval_windows)
                size = model_bytes(model, p.fp_bits, p.fp_bits)
                point = Point(width, canonical_bits(bits), f, fp_steps, qat_steps, loss, size,
                              linear_bytes=size.quantized_weights + size.scales,
                              change_latent=relative_change(block_weights(model), before),
                              change_quantized=relative_change(block_weights(model, quantized=True), before),
                              seconds=time.perf_counter() - start)
                points.append(point)
                on_point(point)
    return points


# -- analysis -----------------------------------------------------------------------------------


def best_over_fractions(points: list[Point]) -> dict[tuple[int, float], Point]:
    """The lowest-loss quantised point per (width, bits)."""
    best: dict[tuple[int, float], Point] = {}
    for pt in points:
        if pt.quantized and ((pt.width, pt.bits) not in best or pt.loss < best[(pt.width, pt.bits)].loss):
            best[(pt.width, pt.bits)] = pt
    return best


def pareto_front(points: list[Point], axis: str = "total") -> list[Point]:
    """The points not dominated by another (fewer-or-equal bytes and lower-or-equal loss, one strictly)."""
    front = []
    for a in points:
        dominated = any(b.size(axis) <= a.size(axis) and b.loss <= a.loss
                        and (b.size(axis) < a.size(axis) or b.loss < a.loss) for b in points)
        if not dominated:
            front.append(a)
    return sorted(front, key=lambda pt: pt.size(axis))


def recipe_fraction(fractions: list[float]) -> float | None:
    """The fine-tuning fraction nearest the authors' 10% (a fraction strictly between 0 and 1)."""
    inner = [f for f in fractions if 0 < f < 1]
    return min(inner, key=lambda f: (abs(f - 0.1), f)) if inner else None


AXES = {"total": "pareto/on_front", "linear": "pareto_linear/on_front"}  # size axis -> headline name


def headline(points: list[Point], p: ParetoQParams) -> dict[str, float]:
    """Headline metrics: mean quantised loss, best fraction, gap at 10%, weight change, bytes, front."""
    quant = [pt for pt in points if pt.quantized]
    top = max(widths_of(p))
    out: dict[str, float] = {"heldout_loss/mean_bits": sum(pt.loss for pt in quant) / len(quant)}
    fp = [pt for pt in points if not pt.quantized and pt.width == top]
    if fp:
        out["heldout_loss/fp16"] = min(fp, key=lambda pt: pt.fraction).loss  # the longest FP phase
    rf = recipe_fraction(list(p.fractions))
    best_points = best_over_fractions(points)
    fronts = {axis: {id(pt) for pt in pareto_front(list(best_points.values()), axis)} for axis in AXES}
    for bits in (canonical_bits(b) for b in p.bits):
        label = bits_label(bits)
        mine = sorted((pt for pt in quant if pt.width == top and pt.bits == bits), key=lambda pt: pt.fraction)
        best = min(mine, key=lambda pt: pt.loss)
        out[f"heldout_loss/b{label}"] = best.loss
        out[f"model_bytes/b{label}"] = float(best.bytes.total)
        if len(mine) > 1:
            out[f"best_qat_fraction/b{label}"] = best.fraction
        at = {pt.fraction: pt for pt in mine}
        if rf is not None:
            out[f"weight_change/b{label}"] = at[rf].change_latent
            if len(mine) > 1:
                out[f"loss_gap_f{rf:g}/b{label}"] = at[rf].loss - best.loss
        for axis, metric in AXES.items():
            out[f"{metric}/b{label}"] = float(sum(id(pt) in fronts[axis] for key, pt in best_points.items()
                                                  if key[1] == bits))
    return out


def best_fraction_rows(points: list[Point], fractions: list[float]) -> list[dict[str, object]]:
    rows = []
    rf = recipe_fraction(fractions)
    for (width, bits), best in sorted(best_over_fractions(points).items()):
        by_f = {pt.fraction: pt.loss for pt in points if pt.quantized and pt.width == width and pt.bits == bits}
        row: dict[str, object] = {"width": width, "bits": bits_label(bits), "best_fraction": best.fraction,
                                  "best_loss": round(best.loss, 5)}
        row.update({f"loss_f{f:g}": round(by_f[f], 5) for f in sorted(by_f)})
        if rf is not None:
            row[f"gap_at_f{rf:g}"] = round(by_f[rf] - best.loss, 5)
        rows.append(row)
    return rows


# -- plots ----------------------------------------------------------------------------------------

_COLOURS = {1.0: "tab:red", TERNARY: "tab:orange", 2.0: "tab:green", 3.0: "tab:blue", 4.0: "tab:purple",
            16.0: "black"}


def _plain_log_ticks(ax) -> None:  # noqa: ANN001
    """Label a log x-axis at 1, 2 and 5 × 10^k in plain numbers."""
    from matplotlib.ticker import FuncFormatter

    def fmt(x: float, _: int) -> str:
        mantissa = x / 10 ** math.floor(math.log10(x)) if x > 0 else 0
        return f"{x:g}" if any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5)) else ""

    ax.xaxis.set_major_formatter(FuncFormatter(fmt))
    ax.xaxis.set_minor_formatter(FuncFormatter(fmt))


def plot_pareto(points: list[Point]):  # noqa: ANN201
    """Loss vs bytes (whole model; block linears only) with the front of the best-over-f points."""
    import matplotlib.pyplot as plt

    best = best_over_fractions(points)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    titles = {"total": "whole model (quantised block linears + scales + 16-bit rest)",
              "linear": "block linears only (packed weights + scales)"}
    for ax, axis in zip(axes, AXES):
        for pt in points:
            if pt.quantized:
                ax.scatter(pt.size(axis) / 1e3, pt.loss, color=_COLOURS[pt.bits], alpha=0.25, s=14)
        seen = set()
        for (width, bits), pt in sorted(best.items()):
            ax.scatter(pt.size(axis) / 1e3, pt.loss, color=_COLOURS[bits], s=46, edgecolor="k", zorder=3,
                       label=f"{bits_label(bits)}-bit (best f)" if bits not in seen else None)
            seen.add(bits)
            ax.annotate(f"d={width}", (pt.size(axis) / 1e3, pt.loss), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        front = pareto_front(list(best.values()), axis)
        ax.plot([pt.size(axis) / 1e3 for pt in front], [pt.loss for pt in front], "k--", lw=1.2,
                label="Pareto front", zorder=2)
        longest: dict[int, Point] = {}
        for pt in points:
            if not pt.quantized and (pt.width not in longest or pt.fp_steps > longest[pt.width].fp_steps):
                longest[pt.width] = pt
        if longest:
            ax.scatter([pt.size(axis) / 1e3 for pt in longest.values()], [pt.loss for pt in longest.values()],
                       marker="*", s=90, color="black", label="16-bit (longest FP phase)")
        ax.set_xscale("log")
        _plain_log_ticks(ax)
        ax.set_xlabel(f"kB: {titles[axis]}")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("ParetoQ: loss vs model size (faint: every QAT fraction; bold: best fraction)")
    return fig


def plot_loss_vs_fraction(points: list[Point], p: ParetoQParams):  # noqa: ANN201
    import matplotlib.pyplot as plt

    widths = widths_of(p)
    fig, axes = plt.subplots(1, len(widths), figsize=(6 * len(widths), 4.5), squeeze=False)
    fracs = sorted(p.fractions)
    for ax, width in zip(axes[0], widths):
        for bits in sorted(canonical_bits(b) for b in p.bits):
            pts = sorted((pt for pt in points if pt.quantized and pt.width == width and pt.bits == bits),
                         key=lambda pt: pt.fraction)
            ax.plot([fracs.index(pt.fraction) for pt in pts], [pt.loss for pt in pts], "o-",
                    color=_COLOURS[bits], label=f"{bits_label(bits)}-bit")
        fp = [pt for pt in points if not pt.quantized and pt.width == width]
        if fp:
            ax.plot([fracs.index(pt.fraction) for pt in sorted(fp, key=lambda q: q.fraction)],
                    [pt.loss for pt in sorted(fp, key=lambda q: q.fraction)], "k:", marker="*",
                    label="16-bit after the FP phase")
        ax.set_xticks(range(len(fracs)), [f"{f:g}" + (" (PTQ)" if f == 0 else " (scratch)" if f == 1 else "")
                                          for f in fracs], fontsize=7)
        ax.set_xlabel(f"QAT fraction f of a {p.budget_steps}-step budget")
        ax.set_ylabel("held-out loss")
        ax.set_title(f"d_model={width}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def plot_weight_change(points: list[Point], p: ParetoQParams):  # noqa: ANN201
    import matplotlib.pyplot as plt

    top = max(widths_of(p))
    bits = sorted(canonical_bits(b) for b in p.bits)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, f in enumerate(sorted(f for f in p.fractions if 0 < f < 1)):
        pts = {pt.bits: pt for pt in points if pt.quantized and pt.width == top and pt.fraction == f}
        ax.plot(range(len(bits)), [pts[b].change_latent for b in bits], "o-", color=f"C{i}",
                label=f"latent weights, f={f:g}")
        ax.plot(range(len(bits)), [pts[b].change_quantized for b in bits], "x:", color=f"C{i}", alpha=0.6,
                label=f"quantised weights, f={f:g}")
    ax.set_xticks(range(len(bits)), [bits_label(b) for b in bits])
    ax.set_xlabel("bits")
    ax.set_ylabel("‖W_after QAT − W_fp‖ / ‖W_fp‖")
    ax.set_title(f"Relative weight change of the block linears (d_model={top})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


# -- the registered method --------------------------------------------------------------------------


@CENTRAL.register("paretoq", params=ParetoQParams,
                  summary="ParetoQ (arXiv 2502.02631): LSQ/SEQ weight QAT at 1/1.58/2/3/4 bits on a tiny Llama; "
                          "sweep bits x QAT fraction of a fixed budget; loss vs bytes Pareto front")
def run_paretoq(ctx: CentralContext) -> dict[str, float]:
    p: ParetoQParams = ctx.params
    n_points = len(widths_of(p)) * len(p.fractions) * len(p.bits)
    ctx.log_params({"budget_tokens": p.budget_steps * base_spec(p).batch_size * base_spec(p).seq_len})
    with ctx.progress(n_points, "paretoq sweep") as bar, torch_threads(p.threads):
        def on_point(pt: Point) -> None:
            tag = f"w{pt.width}/{'fp16' if not pt.quantized else 'b' + bits_label(pt.bits)}/f{pt.fraction:g}"
            ctx.log_metrics({f"loss/{tag}": pt.loss, f"bytes/{tag}": pt.bytes.total}, step=0)
            if pt.quantized:
                bar.advance()

        points = sweep(p, ctx.seed, on_point)
    ctx.log_table([pt.row() for pt in points], "results")
    ctx.log_table(best_fraction_rows(points, list(p.fractions)), "best_fraction")
    for axis in AXES:
        front = pareto_front(list(best_over_fractions(points).values()), axis)
        ctx.log_table([pt.row() for pt in front], f"pareto_front_{axis}")
    ctx.log_figure(plot_pareto(points), "loss_vs_bytes_pareto")
    ctx.log_figure(plot_loss_vs_fraction(points, p), "loss_vs_qat_fraction")
    if recipe_fraction(list(p.fractions)) is not None:
        ctx.log_figure(plot_weight_change(points, p), "weight_change_vs_bits")
    return headline(points, p)


run_paretoq.check = check  # type: ignore[attr-defined]
