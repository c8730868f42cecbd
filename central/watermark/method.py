"""The registered ``watermark`` method: params, checks, the run, tables and plots."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedsim.contracts.central import CentralContext
from central.watermark.experiment import (Detection, Streams, detection_curves, dirichlet_pool, entropy,
                                          lm_streams, plain_picker, pool_distortion, prompt_windows, repetition,
                                          scheme_picker, synthetic_streams)
from central.watermark.schemes import SCHEMES, OTScheme, SchemeConfig, make_scheme
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL

LMS = ("drafter", "target", "test", "smollm2")


@dataclass
class WatermarkParams:
    schemes: list[str] = field(default_factory=lambda: list(SCHEMES))
    tokens: list[int] = field(default_factory=lambda: [25, 50, 100, 200])  # T at which TPR is reported
    fpr: float = 0.01
    key: int = 15485863
    dedup: bool = False  # score each (previous token, token) pair once per sequence (the authors score all)
    # the OT schemes (the authors' defaults)
    top_p: float = 0.999
    sinkhorn_reg: float = 0.05
    sinkhorn_iters: int = 2000
    sinkhorn_thresh: float = 1.0e-5
    sinkhorn_dtype: str = "float32"  # deviation for speed: the authors' POT call runs in float64 (same iterations)
    tilt: float = 0.0
    heavy_side: int = 1024
    # the baselines
    gamma: float = 0.5
    delta: float = 2.0
    # synthetic distribution streams: entropy bins (nats) of Dirichlet next-token distributions
    vocab: int = 256
    regimes: list[str] = field(default_factory=lambda: ["low", "high"])  # which entropy bins to run
    low_entropy: list[float] = field(default_factory=lambda: [0.2, 1.0])
    high_entropy: list[float] = field(default_factory=lambda: [2.0, 3.0])
    pool: int = 256
    sequences: int = 300
    null_sequences: int = 2000
    distortion_draws: int = 1024
    mc_draws: int = 500  # Monte-Carlo draws of HeavyWater's exact p-value (FPR check only)
    # real generations: tiny LMs of the kit ("drafter", "target", "test") and/or "smollm2"
    lms: list[str] = field(default_factory=lambda: ["drafter"])
    lm_sequences: int = 16
    lm_null_sequences: int = 400
    prompt_tokens: int = 32
    temperature: float = 1.0


def check(p: WatermarkParams) -> None:
    """One-line ConfigErrors for bad values (before any run starts)."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"params.{msg}")

    need(len(p.schemes) > 0 and set(p.schemes) <= set(SCHEMES) and len(set(p.schemes)) == len(p.schemes),
         f"schemes must be distinct names from {list(SCHEMES)}, got {p.schemes}")
    need(len(p.tokens) > 0 and all(t >= 1 for t in p.tokens), f"tokens must be positive token counts, got {p.tokens}")
    need(0 < p.fpr < 0.5, f"fpr must be in (0, 0.5), got {p.fpr}")
    need(p.key >= 0, f"key must be >= 0, got {p.key}")
    need(0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}")
    need(p.sinkhorn_reg > 0 and p.sinkhorn_thresh > 0 and p.sinkhorn_iters >= 1,
         "sinkhorn_reg and sinkhorn_thresh must be > 0 and sinkhorn_iters >= 1")
    need(p.sinkhorn_dtype in ("float32", "float64"),
         f"sinkhorn_dtype must be float32 or float64, got {p.sinkhorn_dtype!r}")
    need(0 <= p.tilt < 1, f"tilt must be in [0, 1), got {p.tilt}")
    need(p.heavy_side >= 2, f"heavy_side must be >= 2, got {p.heavy_side}")
    need(0 < p.gamma < 1 and int(p.gamma * p.vocab) >= 1,
         f"gamma must be in (0, 1) and leave a green token, got {p.gamma}")
    need(p.delta >= 0, f"delta must be >= 0, got {p.delta}")
    need(2 <= p.vocab <= 65536, f"vocab must be in [2, 65536], got {p.vocab}")
    need(set(p.regimes) <= {"low", "high"} and len(set(p.regimes)) == len(p.regimes),
         f"regimes must be distinct names from ['low', 'high'], got {p.regimes}")
    for name in ("low", "high"):
        bounds = getattr(p, f"{name}_entropy")
        need(len(bounds) == 2 and 0 <= bounds[0] < bounds[1] <= math.log(p.vocab),
             f"{name}_entropy must be [low, high] nats with 0 <= low < high <= log(vocab)="
             f"{math.log(p.vocab):.2f}, got {bounds}")
    need(set(p.lms) <= set(LMS) and len(set(p.lms)) == len(p.lms),
         f"lms must be distinct names from {list(LMS)}, got {p.lms}")
    need(bool(p.regimes) or bool(p.lms), "regimes and lms are both empty: nothing to run")
    need(min(p.pool, p.sequences, p.lm_sequences, p.distortion_draws, p.mc_draws, p.prompt_tokens) >= 1,
         "pool, sequences, lm_sequences, distortion_draws, mc_draws and prompt_tokens must be >= 1")
    for key, used in (("null_sequences", p.regimes), ("lm_null_sequences", p.lms)):
        n = getattr(p, key)
        need(not used or n // 2 * p.fpr >= 1, f"{key}={n} is too few: half of them calibrate the threshold, "
                                              f"so need >= {math.ceil(2 / p.fpr)} at fpr={p.fpr}")
    need(p.temperature > 0, f"temperature must be > 0, got {p.temperature}")


def scheme_config(p: WatermarkParams) -> SchemeConfig:
    return SchemeConfig(top_p=p.top_p, reg=p.sinkhorn_reg, max_iter=p.sinkhorn_iters, stop_thr=p.sinkhorn_thresh,
                        tilt=p.tilt, heavy_side=p.heavy_side, gamma=p.gamma, delta=p.delta, dtype=p.sinkhorn_dtype)


def _pct(alpha: float) -> str:
    return f"{alpha * 100:g}pct"


# ------------------------------------------------------------------------------------------------
# the two test beds
# ------------------------------------------------------------------------------------------------
def run_synthetic(ctx: CentralContext, regime: str, bounds: list[float], T_max: int,
                  results: dict[str, Any]) -> None:
    p = ctx.params
    pool = dirichlet_pool(ctx.rng("pool", regime), p.vocab, bounds[0], bounds[1], p.pool)
    null = synthetic_streams(None, pool, None, p.null_sequences, T_max, ctx.rng("null", regime))
    for name in p.schemes:
        start = time.perf_counter()
        scheme = make_scheme(name, p.vocab, p.key, scheme_config(p))
        coupling = scheme.couple(pool, with_average=True) if isinstance(scheme, OTScheme) else None
        wm = synthetic_streams(scheme, pool, coupling, p.sequences, T_max, ctx.rng("wm", regime, name))
        det = detection_curves(scheme, wm, null, p.fpr, sorted(p.tokens), ctx.rng("detect", regime, name), p.mc_draws,
                               p.dedup)
        dist = pool_distortion(scheme, pool, coupling, p.distortion_draws, ctx.rng("distortion", regime, name))
        dist["entropy"] = float(entropy(pool).mean())
        if coupling is not None:
            dist["sinkhorn_iters"] = float(coupling.iters.mean())
        dist["seconds"] = time.perf_counter() - start
        results["detection"][(name, regime)] = det
        results["distortion"][(name, regime)] = dist


def load_lm(name: str) -> tuple[Any, Any, int]:
    """(model, the held-out corpus as token ids, the vocabulary size of the logits)."""
    if name == "smollm2":
        from central.lm.corpus import load_corpus
        from central.lm.smollm import load_smollm2

        model, tok = load_smollm2()
        ids = torch.tensor(tok(load_corpus().heldout_text(400_000))["input_ids"], dtype=torch.long)
        return model, ids, int(model.config.vocab_size)
    from central.lm import tiny

    spec = tiny.preset(name)
    model, _ = tiny.load_or_train(spec)
    ids = tiny.corpus_ids(tiny.tokenizer_for(spec), "heldout", 400_000)
    return model, ids, spec.vocab_size


def run_lm(ctx: CentralContext, lm: str, T_max: int, results: dict[str, Any]) -> None:
    p = ctx.params
    model, ids, vocab = load_lm(lm)
    prompts = prompt_windows(ids, max(p.lm_sequences, p.lm_null_sequences), p.prompt_tokens, ctx.rng("prompts", lm))
    total = (p.lm_null_sequences + len(p.schemes) * p.lm_sequences) * T_max
    with ctx.progress(total, f"watermark: {lm} generations") as bar:
        start = time.perf_counter()
        null = lm_streams(model, prompts[: p.lm_null_sequences], T_max, plain_picker(ctx.rng("null", lm)),
                          p.temperature, on_step=bar.advance)
        same_prompts = Streams(null.tokens[: p.lm_sequences], null.prev[: p.lm_sequences],
                               {k: v[: p.lm_sequences] for k, v in null.extra.items()})
        results["lm"][("none", lm)] = _lm_row(same_prompts, {}, time.perf_counter() - start)
        for name in p.schemes:
            start = time.perf_counter()
            scheme = make_scheme(name, vocab, p.key, scheme_config(p))
            log: dict[str, list[np.ndarray]] = {}
            pick = scheme_picker(scheme, ctx.rng("wm", lm, name), log)
            wm = lm_streams(model, prompts[: p.lm_sequences], T_max, pick, p.temperature, on_step=bar.advance)
            results["detection"][(name, lm)] = detection_curves(scheme, wm, null, p.fpr, sorted(p.tokens),
                                                                ctx.rng("detect", lm, name), p.mc_draws, p.dedup)
            if not p.dedup:  # watermarked LM text repeats (prev, token) pairs: also score each pair once
                results["detection"][(name, f"{lm}-dedup")] = detection_curves(
                    scheme, wm, null, p.fpr, sorted(p.tokens), ctx.rng("detect-dedup", lm, name), p.mc_draws, True)
            results["lm"][(name, lm)] = _lm_row(wm, log, time.perf_counter() - start)


def _lm_row(s: Streams, log: dict[str, list[np.ndarray]], seconds: float) -> dict[str, float]:
    """Perplexity under the unwatermarked model, mean entropy and repetition (:func:`repetition`)."""
    row = {"ppl": float(np.exp(s.extra["nll"].mean())), "entropy": float(s.extra["entropy"].mean()),
           **repetition(s), "seconds": seconds}
    if log:
        row["kl_mean"] = float(np.concatenate(log["kl"]).mean())
        row["kl_max"] = float(np.concatenate(log["kl"]).max())
        row["sinkhorn_iters"] = float(np.concatenate(log["iters"]).mean())
    return row


# ------------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------------
def headline(p: WatermarkParams, results: dict[str, Any]) -> dict[str, float]:
    pct, out = _pct(p.fpr), {}
    first = p.schemes[0]
    for (name, regime), det in results["detection"].items():
        for T in sorted(p.tokens):
            out[f"tpr_at_{pct}/{name}/{regime}/T{T}"] = float(det.tpr[T - 1])
            out[f"fpr_heldout/{name}/{regime}/T{T}"] = float(det.fpr_heldout[T - 1])
            out[f"fpr_nominal/{name}/{regime}/T{T}"] = det.fpr_nominal[T]
            if name == first:
                out[f"tpr_at_{pct}/{regime}/T{T}"] = float(det.tpr[T - 1])
                out[f"fpr_heldout/{regime}/T{T}"] = float(det.fpr_heldout[T - 1])
                out[f"fpr_nominal/{regime}/T{T}"] = det.fpr_nominal[T]
        out[f"tokens_to_tpr90/{name}/{regime}"] = det.tokens_to(0.9)
        if name == first:
            out[f"tokens_to_tpr90/{regime}"] = det.tokens_to(0.9)
    for name in p.schemes:
        kls = [d["kl_mean"] for (n, _), d in results["distortion"].items() if n == name]
        if kls:
            out[f"kl/{name}"] = float(np.mean(kls))
    for (name, regime), d in results["distortion"].items():
        out[f"kl/{name}/{regime}"] = d["kl_mean"]
    for (name, lm), row in results["lm"].items():
        for key in ("ppl", "ppl_first_pairs", "repeated_pairs", "distinct_2", "entropy"):
            out[f"{key}/{name}/{lm}"] = row[key]
        if "kl_mean" in row:
            out[f"kl/{name}/{lm}"] = row["kl_mean"]
    return out


def detection_rows(p: WatermarkParams, results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for (name, regime), det in results["detection"].items():
        for T in sorted(p.tokens):
            row = {"scheme": name, "regime": regime, "T": T, "tpr": float(det.tpr[T - 1]),
                   "z_threshold": float(det.threshold[T - 1]), "fpr_heldout": float(det.fpr_heldout[T - 1]),
                   "fpr_nominal": det.fpr_nominal[T]}
            if det.fpr_normal:
                row["fpr_normal_approx"] = det.fpr_normal[T]
            rows.append(row)
    return rows


def summary_rows(p: WatermarkParams, results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for (name, regime), det in results["detection"].items():
        row: dict[str, Any] = {"scheme": name, "regime": regime}
        row.update({f"tpr@T{T}": float(det.tpr[T - 1]) for T in sorted(p.tokens)})
        row["tokens_to_tpr90"] = det.tokens_to(0.9)
        dist = results["distortion"].get((name, regime)) or results["lm"].get((name, regime), {})
        if "kl_mean" in dist:
            row["kl"] = dist["kl_mean"]
        for key in ("ppl", "ppl_first_pairs", "repeated_pairs", "distinct_2"):  # LM text: repetition next to ppl
            if key in dist:
                row[key] = dist[key]
        rows.append(row)
    return rows


def plot_tpr(p: WatermarkParams, results: dict[str, Any]) -> Any:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    regimes = list(dict.fromkeys(r for _, r in results["detection"]))
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.2 * len(regimes), 3.6), squeeze=False, sharey=True)
    for ax, regime in zip(axes[0], regimes):
        for name in p.schemes:
            det: Detection | None = results["detection"].get((name, regime))
            if det is None:
                continue
            T = np.arange(1, len(det.tpr) + 1)
            (line,) = ax.plot(T, det.tpr, label=name, lw=1.4)
            ax.plot(sorted(p.tokens), det.tpr[np.asarray(sorted(p.tokens)) - 1], "o", color=line.get_color(), ms=4)
        ent = _regime_entropy(results, regime)
        ax.set_title(f"{regime} (mean H = {ent:.2f} nats)")
        ax.set_xlabel("text length T (tokens)")
        ax.axhline(0.9, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"TPR at {p.fpr:g} FPR (threshold from null)")
    axes[0][0].legend(loc="lower right")
    fig.tight_layout()
    return fig


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else math.inf)


def _regime_entropy(results: dict[str, Any], regime: str) -> float:
    regime = regime.removesuffix("-dedup")
    for (_, r), d in list(results["distortion"].items()) + list(results["lm"].items()):
        if r == regime:
            return d["entropy"]
    return float("nan")


def plot_distortion(p: WatermarkParams, results: dict[str, Any]) -> Any:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    items = [(k, d) for k, d in results["distortion"].items()]
    items += [(k, d) for k, d in results["lm"].items() if "kl_mean" in d]
    regimes = list(dict.fromkeys(r for (_, r), _ in items))
    fig, ax = plt.subplots(figsize=(1.2 + 1.6 * max(1, len(regimes)), 3.4))
    width = 0.8 / len(p.schemes)
    for i, name in enumerate(p.schemes):
        vals = [next((d["kl_mean"] for (n, r), d in items if n == name and r == reg), np.nan) for reg in regimes]
        ax.bar(np.arange(len(regimes)) + i * width, np.maximum(vals, 1e-16), width, label=name)
    ax.set_xticks(np.arange(len(regimes)) + 0.4 - width / 2, regimes)
    ax.set_yscale("log")
    ax.set_ylabel("KL(P ‖ P̂), P̂ = mean sampling dist. over s")
    ax.set_title("distortion (OT: exact; Red-Green, Gumbel: Monte Carlo)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


@CENTRAL.register("watermark", params=WatermarkParams,
                  summary="HeavyWater & SimplexWater (OT watermarks) vs Red-Green and Gumbel: "
                          "TPR at 1% FPR vs tokens, distortion")
def run_watermark(ctx: CentralContext) -> dict[str, float]:
    p: WatermarkParams = ctx.params
    T_max = max(p.tokens)
    results: dict[str, Any] = {"detection": {}, "distortion": {}, "lm": {}}
    with ctx.progress(len(p.regimes), "watermark: synthetic regimes") as bar:
        for regime in p.regimes:
            try:
                run_synthetic(ctx, regime, list(getattr(p, f"{regime}_entropy")), T_max, results)
            except ValueError as exc:
                raise ConfigError(f"params.{regime}_entropy: {exc}") from None
            bar.advance()
    for lm in p.lms:
        run_lm(ctx, lm, T_max, results)
    pct = _pct(p.fpr)
    for (name, regime), det in results["detection"].items():
        for T in sorted(p.tokens):
            ctx.log_metrics({f"tpr_at_{pct}/{name}/{regime}": float(det.tpr[T - 1]),
                             f"fpr_nominal/{name}/{regime}": det.fpr_nominal[T],
                             f"fpr_heldout/{name}/{regime}": float(det.fpr_heldout[T - 1])}, step=T)
    ctx.log_table(summary_rows(p, results), "summary")
    ctx.log_table(detection_rows(p, results), "detection")
    ctx.log_table([{"scheme": n, "regime": r, **d} for (n, r), d in results["distortion"].items()], "distortion")
    if results["lm"]:
        base = {lm: row for (n, lm), row in results["lm"].items() if n == "none"}
        ctx.log_table([{"scheme": n, "lm": lm, **row, "ppl_change": row["ppl"] - base[lm]["ppl"],
                        "repeated_pairs_ratio": _ratio(row["repeated_pairs"], base[lm]["repeated_pairs"])}
                       for (n, lm), row in results["lm"].items()], "lm")
    ctx.log_figure(plot_tpr(p, results), "tpr_vs_tokens")
    ctx.log_figure(plot_distortion(p, results), "distortion")
    return headline(p, results)


run_watermark.check = check  # type: ignore[attr-defined]
