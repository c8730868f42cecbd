"""The registered ``spam_select`` method: params, checks, the signal sweep, tables, plots, headline."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsim.contracts.central import CentralContext
from central.spam_select import baselines as B
from central.spam_select import selectors as S
from central.spam_select.sequence import (PROFILES, Scenario, chi2_bound_rate, dyadic_grid, estimation_width,
                                          flat_width, make_theta, minimax_rate, oracle_width, recovery_x, simulate,
                                          stat_threshold, testing_x)
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL

SELECTORS = ("sr_oracle", "sr_adaptive", "sr_full", "bh_oracle", "bh_adaptive", "glasso", "glasso_risk")
MAX_CHUNK_FLOATS = 50_000_000  # one chunk of y: chunk × d × K float32


@dataclass
class SpamSelectParams:
    # (n, d, s, β) per scenario
    scenarios: list[list[float]] = field(default_factory=lambda: [
        [1000, 400, 10, 1.0], [8000, 400, 10, 1.0], [1000, 1600, 10, 1.0], [1000, 400, 10, 2.0]])
    selectors: list[str] = field(default_factory=lambda: list(SELECTORS))
    # signal ‖θ_j‖ of each active variable, in units of the scenario's closed-form minimax support-recovery
    # rate (sequence.support_recovery_rate); the transitions sit at 1.7-2.7 of it
    signals: list[float] = field(default_factory=lambda: [0.7, 1.0, 1.2, 1.4, 1.55, 1.7, 1.85, 2.0, 2.2, 2.4, 2.7, 3.0,
                                                          3.5, 4.0, 5.0])
    reps: int = 200
    K: int = 64  # basis functions per variable
    sigma: float = 1.0
    radius: float = 1.0  # Sobolev radius L
    shape: str = "flat"  # "flat" (least favourable) or "decay"
    q: float = 0.1  # BH level
    delta: float = 0.5  # support recovery at per-variable level d^{-(1+δ)}
    ref_signal: float = 3.0  # where exact_at_ref / risk_at_ref are read (added to the signals if absent)
    chunk: int = 25  # repetitions simulated at once


def scenarios_of(p: SpamSelectParams) -> list[Scenario]:
    return [Scenario(int(n), int(d), int(s), float(beta), p.sigma, p.radius, p.K) for n, d, s, beta in p.scenarios]


def check(p: SpamSelectParams) -> None:
    """One-line ConfigErrors for bad values (before any run starts)."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"params.{msg}")

    need(len(p.scenarios) > 0, "scenarios must list at least one [n, d, s, beta]")
    for row in p.scenarios:
        need(len(row) == 4, f"scenarios entries must be [n, d, s, beta], got {row}")
        n, d, s, beta = row
        need(all(float(v).is_integer() for v in (n, d, s)), f"scenarios: n, d and s must be integers, got {row}")
        need(n >= 1 and d >= 2 and 0 <= s < d, f"scenarios: need n >= 1, d >= 2 and 0 <= s < d, got {row}")
        need(beta > 0, f"scenarios: beta must be > 0, got {row}")
        need(p.chunk * d * p.K <= MAX_CHUNK_FLOATS, f"chunk x d x K must be <= {MAX_CHUNK_FLOATS:.0e}, got {row}")
    need(len(p.selectors) > 0 and set(p.selectors) <= set(SELECTORS) and len(set(p.selectors)) == len(p.selectors),
         f"selectors must be distinct names from {list(SELECTORS)}, got {p.selectors}")
    need(len(p.signals) > 0 and all(c > 0 for c in p.signals), f"signals must be positive, got {p.signals}")
    need(p.reps >= 2, f"reps must be >= 2, got {p.reps}")
    need(p.K >= 2, f"K must be >= 2, got {p.K}")
    need(p.sigma > 0 and p.radius > 0, f"sigma and radius must be > 0, got {p.sigma}, {p.radius}")
    need(p.shape in PROFILES, f"shape must be one of {list(PROFILES)}, got {p.shape!r}")
    need(0 < p.q < 1, f"q must be in (0, 1), got {p.q}")
    need(p.delta >= 0, f"delta must be >= 0, got {p.delta}")
    need(p.ref_signal > 0, f"ref_signal must be > 0, got {p.ref_signal}")
    need(p.chunk >= 1, f"chunk must be >= 1, got {p.chunk}")


# -- one scenario ----------------------------------------------------------------------------------

@dataclass
class Plan:
    """What a scenario's selectors need: the units, truncations, the grid and the simulated levels."""

    scn: Scenario
    grid: list[int]
    rho_sr: float  # the signal unit: closed-form minimax support-recovery rate (x = log d)
    rho_mt: float  # closed-form minimax FDR + FNR rate (x = log(d/s))
    rho_sr_adaptive: float  # the same formula at x = log d + log|grid|
    rho_mt_adaptive: float
    bound_sr: float  # the χ² (Laurent–Massart) bound the selectors threshold on: only sets m_sr
    bound_mt: float  # ... and m_mt
    m_sr: int  # oracle truncations (know β)
    m_mt: int
    m_est: int  # estimation-optimal truncation (group lasso)
    levels: list[int]


def plan(scn: Scenario) -> Plan:
    grid = dyadic_grid(scn.K)
    x_sr, x_mt = recovery_x(scn), testing_x(scn)
    log_g = math.log(len(grid))
    m_sr, m_mt, m_est = oracle_width(scn, x_sr), oracle_width(scn, x_mt), estimation_width(scn)
    return Plan(scn, grid, minimax_rate(scn, x_sr), minimax_rate(scn, x_mt), minimax_rate(scn, x_sr + log_g),
                minimax_rate(scn, x_mt + log_g), chi2_bound_rate(scn, x_sr), chi2_bound_rate(scn, x_mt),
                m_sr, m_mt, m_est, sorted(set(grid) | {m_sr, m_mt, m_est}))


def select(name: str, en: Any, pl: Plan, p: SpamSelectParams, theta: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
    """The (reps, d) selections of one selector, plus what it chose (truncation, λ)."""
    scn, eps = pl.scn, pl.scn.eps
    if name == "sr_oracle":
        return S.sr_fixed(en, pl.m_sr, eps, scn.d, p.delta), {"m": pl.m_sr}
    if name == "sr_full":
        return S.sr_fixed(en, scn.K, eps, scn.d, p.delta), {"m": scn.K}
    if name == "sr_adaptive":
        return S.sr_adaptive(en, pl.grid, eps, scn.d, p.delta), {"m": "grid"}
    if name == "bh_oracle":
        return S.bh_fixed(en, pl.m_mt, eps, p.q), {"m": pl.m_mt}
    if name == "bh_adaptive":
        return S.bh_adaptive(en, pl.grid, eps, p.q), {"m": "grid"}
    if name == "glasso":
        lam = B.universal_lambda(pl.m_est, eps, scn.d)
        return B.glasso_select(en, pl.m_est, lam), {"m": pl.m_est, "lam_over_eps": lam / eps}
    if name == "glasso_risk":
        tune = B.tune_for_risk(en, pl.levels, eps, scn.d, theta, pl.m_est)
        return B.glasso_select(en, tune.m, tune.lam), {"m": tune.m, "lam_over_eps": tune.lam / eps,
                                                       "est_risk": tune.risk, "est_risk_universal": tune.universal_risk}
    raise ValueError(f"unknown selector {name!r}")


def sweep(ctx: CentralContext, pl: Plan, signals: list[float], bar: Any) -> list[dict[str, Any]]:
    """All selectors at every signal level of one scenario: one curve row per (selector, signal)."""
    p, scn = ctx.params, pl.scn
    rows = []
    for c in signals:
        rho = c * pl.rho_sr
        theta = make_theta(rho, scn, ctx.rng("theta", scn.label, f"{c:g}"), p.shape)
        en = simulate(theta, scn.eps, p.reps, pl.levels, ctx.rng("noise", scn.label, f"{c:g}"), p.chunk)
        for name in p.selectors:
            mask, chosen = select(name, en, pl, p, theta)
            met = S.selection_metrics(mask, scn.s)
            rows.append({"scenario": scn.label, "selector": name, "signal": c, "signal_mt": rho / pl.rho_mt,
                         "rho": rho, "width": flat_width(rho, scn.beta, scn.radius, scn.K) if p.shape == "flat"
                         else scn.K, "fdr": met.fdr, "fnr": met.fnr, "risk": met.risk, "exact": met.exact,
                         "hamming": met.hamming, "fdr_se": met.fdr_se, "exact_se": met.exact_se, **chosen})
        bar.advance()
    return rows


# -- transitions -----------------------------------------------------------------------------------

def crossing(x: np.ndarray, y: np.ndarray, level: float, rising: bool) -> float:
    """The first x where y crosses ``level`` (log-linear interpolation); x[0] if it starts past the
    level, nan if it never gets there."""
    past = y >= level if rising else y <= level
    hits = np.nonzero(past)[0]
    if hits.size == 0:
        return float("nan")
    i = int(hits[0])
    if i == 0:
        return float(x[0])
    t = (level - y[i - 1]) / (y[i] - y[i - 1])
    return float(math.exp(math.log(x[i - 1]) + t * (math.log(x[i]) - math.log(x[i - 1]))))


def transitions(rows: list[dict[str, Any]], plans: dict[str, Plan]) -> list[dict[str, Any]]:
    """Per (scenario, selector): the signal where P(exact) reaches ½ (support-recovery units) and where
    FDR + FNR falls to ½ (FDR + FNR units), in rate units and in raw ‖θ_j‖."""
    out = []
    for label, pl in plans.items():
        for name in dict.fromkeys(r["selector"] for r in rows):
            cur = sorted((r for r in rows if r["scenario"] == label and r["selector"] == name), key=lambda r: r["rho"])
            if not cur:
                continue
            rho = np.array([r["rho"] for r in cur])
            c_exact = crossing(rho, np.array([r["exact"] for r in cur]), 0.5, True) / pl.rho_sr
            c_risk = crossing(rho, np.array([r["risk"] for r in cur]), 0.5, False) / pl.rho_mt
            out.append({"scenario": label, "selector": name, "c50_exact": c_exact, "rho50_exact": c_exact * pl.rho_sr,
                        "c50_risk": c_risk, "rho50_risk": c_risk * pl.rho_mt})
    return out


def _median(values: list[float]) -> float:
    finite = [v for v in values if np.isfinite(v)]
    return float(np.median(finite)) if len(finite) == len(values) and finite else float("nan")


def _log(value: float) -> float:
    return math.log(value) if np.isfinite(value) and value > 0 else float("nan")


def _spread(values: list[float]) -> float:
    arr = np.asarray(values, dtype=float)
    return float(arr.max() / arr.min()) if arr.size and np.all(np.isfinite(arr)) else float("nan")


def headline(p: SpamSelectParams, rows: list[dict[str, Any]], trans: list[dict[str, Any]],
             plans: dict[str, Plan]) -> dict[str, float]:
    """Headline metrics (see the module docstring of :mod:`central.spam_select`)."""
    out: dict[str, float] = {}
    by = {(t["scenario"], t["selector"]): t for t in trans}
    ref = [r for r in rows if math.isclose(r["signal"], p.ref_signal)]
    for name in p.selectors:
        out[f"transition/exact/{name}"] = _median([by[lab, name]["c50_exact"] for lab in plans])
        out[f"transition/risk/{name}"] = _median([by[lab, name]["c50_risk"] for lab in plans])
        out[f"transition_raw/exact/{name}"] = _median([by[lab, name]["rho50_exact"] for lab in plans])
        out[f"exact_at_ref/{name}"] = float(np.mean([r["exact"] for r in ref if r["selector"] == name]))
        out[f"risk_at_ref/{name}"] = float(np.mean([r["risk"] for r in ref if r["selector"] == name]))
        mine = [r for r in rows if r["selector"] == name]
        out[f"exact_max/{name}"] = float(max(r["exact"] for r in mine))
        out[f"fdr_mean/{name}"] = float(np.mean([r["fdr"] for r in mine]))  # pooled over cells
        out[f"fdr_max/{name}"] = float(max(r["fdr"] for r in mine))  # the largest noisy cell estimate
    first = p.selectors[0]
    for key in ("transition/exact", "transition/risk", "exact_at_ref", "risk_at_ref", "exact_max"):  # the claim grid
        out[f"headline/{key.replace('/', '_')}"] = out[f"{key}/{first}"]
    # natural logs, so that a claim's difference is a log-ratio and a factor f is the margin log f
    out["headline/log_transition_exact"] = _log(out[f"transition/exact/{first}"])
    out["headline/log_rho_transition_exact"] = _log(out[f"transition_raw/exact/{first}"])
    if "sr_oracle" in p.selectors and len(plans) > 1:
        out["collapse/exact/spread_rate_units"] = _spread([by[lab, "sr_oracle"]["c50_exact"] for lab in plans])
        out["collapse/exact/spread_raw"] = _spread([by[lab, "sr_oracle"]["rho50_exact"] for lab in plans])
    if "bh_oracle" in p.selectors and len(plans) > 1:
        out["collapse/risk/spread_rate_units"] = _spread([by[lab, "bh_oracle"]["c50_risk"] for lab in plans])
        out["collapse/risk/spread_raw"] = _spread([by[lab, "bh_oracle"]["rho50_risk"] for lab in plans])
    for base, adaptive, key, rate in (("sr_oracle", "sr_adaptive", "c50_exact", "sr"),
                                      ("bh_oracle", "bh_adaptive", "c50_risk", "mt")):
        if {base, adaptive} <= set(p.selectors):
            kind = "exact" if rate == "sr" else "risk"
            out[f"adapt/cost_{kind}"] = _median([by[lab, adaptive][key] / by[lab, base][key] for lab in plans])
            out[f"adapt/cost_{kind}_predicted"] = float(np.median(
                [getattr(pl, f"rho_{rate}_adaptive") / getattr(pl, f"rho_{rate}") for pl in plans.values()]))
    for name in ("glasso", "glasso_risk", "sr_full"):
        if {name, "sr_oracle"} <= set(p.selectors):
            out[f"excess_exact/{name}"] = _median([by[lab, name]["c50_exact"] / by[lab, "sr_oracle"]["c50_exact"]
                                                   for lab in plans])
    return out


# -- tables and plots ------------------------------------------------------------------------------

def scenario_rows(plans: dict[str, Plan]) -> list[dict[str, Any]]:
    return [{"scenario": lab, "n": pl.scn.n, "d": pl.scn.d, "s": pl.scn.s, "beta": pl.scn.beta, "eps": pl.scn.eps,
             "rho_sr": pl.rho_sr, "rho_mt": pl.rho_mt, "rho_sr_adaptive": pl.rho_sr_adaptive,
             "rho_mt_adaptive": pl.rho_mt_adaptive, "chi2_bound_sr": pl.bound_sr, "chi2_bound_mt": pl.bound_mt,
             "bound_over_unit_sr": pl.bound_sr / pl.rho_sr, "m_oracle_sr": pl.m_sr, "m_oracle_mt": pl.m_mt,
             "m_est": pl.m_est, "grid": " ".join(map(str, pl.grid))} for lab, pl in plans.items()]


def threshold_rows(plans: dict[str, Plan], delta: float) -> list[dict[str, Any]]:
    """τ_m at the support-recovery level next to the √(2(1+δ) log d) asymptote and Laurent–Massart."""
    out = []
    for lab, pl in plans.items():
        alpha = S.recovery_alpha(pl.scn.d, delta)
        x = math.log(1 / alpha)
        for m in pl.grid:
            out.append({"scenario": lab, "m": m, "tau_fixed": float(stat_threshold(m, alpha)),
                        "tau_adaptive": float(stat_threshold(m, alpha / len(pl.grid))),
                        "laurent_massart": math.sqrt(2 * x) + math.sqrt(2) * x / math.sqrt(m),
                        "asymptote": math.sqrt(2 * x)})
    return out


def _log_axis(ax: Any) -> None:
    """A log x-axis with plain major labels and no crowded minor labels."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _panels(n: int) -> tuple[Any, np.ndarray]:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    cols = min(n, 2)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.2 * cols, 3.8 * rows_), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes.flat


def plot_metric(rows: list[dict[str, Any]], plans: dict[str, Plan], metric: str, x: str, ylabel: str,
                hline: float | None = None, dashed: str | None = None) -> Any:
    """One panel per scenario, one curve per selector (optionally a second, dashed metric)."""
    fig, axes = _panels(len(plans))
    for ax, lab in zip(axes, plans):
        for i, name in enumerate(dict.fromkeys(r["selector"] for r in rows)):
            cur = sorted((r for r in rows if r["scenario"] == lab and r["selector"] == name), key=lambda r: r[x])
            xs = [r[x] for r in cur]
            ax.plot(xs, [r[metric] for r in cur], marker="o", ms=3, color=f"C{i}", label=name)
            if dashed:
                ax.plot(xs, [r[dashed] for r in cur], ls="--", color=f"C{i}")
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls=":")
        _log_axis(ax)
        ax.set_title(lab, fontsize=9)
        ax.set_xlabel("signal ‖θ_j‖ / minimax rate (closed form)" + (" (FDR+FNR)" if x == "signal_mt" else ""))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_collapse(rows: list[dict[str, Any]], plans: dict[str, Plan], selectors: list[str]) -> Any | None:
    """P(exact) / FDR + FNR per scenario against the raw ‖θ_j‖ and in units of the closed-form minimax rate."""
    specs = [(sel, metric, unit) for sel, metric, unit in (("sr_oracle", "exact", "signal"),
                                                          ("sr_adaptive", "exact", "signal"),
                                                          ("bh_oracle", "risk", "signal_mt"),
                                                          ("bh_adaptive", "risk", "signal_mt")) if sel in selectors]
    if not specs:
        return None
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(specs), 2, figsize=(10, 3.4 * len(specs)), squeeze=False)
    for (sel, metric, unit), (ax_raw, ax_unit) in zip(specs, axes):
        for i, lab in enumerate(plans):
            cur = sorted((r for r in rows if r["scenario"] == lab and r["selector"] == sel), key=lambda r: r["rho"])
            ax_raw.plot([r["rho"] for r in cur], [r[metric] for r in cur], marker="o", ms=3, color=f"C{i}", label=lab)
            ax_unit.plot([r[unit] for r in cur], [r[metric] for r in cur], marker="o", ms=3, color=f"C{i}")
        for ax, xl in ((ax_raw, "‖θ_j‖ (raw)"), (ax_unit, "‖θ_j‖ / minimax rate (closed form)")):
            _log_axis(ax)
            ax.set_xlabel(xl)
            ax.set_ylabel(f"{metric} ({sel})")
            ax.grid(alpha=0.3)
        ax_raw.legend(fontsize=7)
    fig.suptitle("transition scaling: curves in raw ‖θ_j‖ and in units of the closed-form minimax rate")
    fig.tight_layout()
    return fig


# -- the method ------------------------------------------------------------------------------------

@CENTRAL.register("spam_select", params=SpamSelectParams,
                  summary="SpAM variable selection in the Gaussian sequence model: χ² selectors (BH, √(2 log d) "
                          "threshold, adaptive over a dyadic grid) vs group lasso and a smoothness oracle")
def run_spam_select(ctx: CentralContext) -> dict[str, float]:
    p: SpamSelectParams = ctx.params
    plans = {scn.label: plan(scn) for scn in scenarios_of(p)}
    signals = sorted(set(p.signals) | {p.ref_signal})
    rows: list[dict[str, Any]] = []
    with ctx.progress(len(plans) * len(signals), "spam_select sweep") as bar:
        for pl in plans.values():
            rows += sweep(ctx, pl, signals, bar)
    trans = transitions(rows, plans)
    head = headline(p, rows, trans, plans)
    for step, c in enumerate(signals):  # per-signal curves, averaged over scenarios
        at_c = [r for r in rows if r["signal"] == c]
        ctx.log_metrics({f"{m}/{name}": float(np.mean([r[m] for r in at_c if r["selector"] == name]))
                         for name in p.selectors for m in ("exact", "fdr", "fnr")}, step=step)
    ctx.log_table(scenario_rows(plans), "scenarios")
    ctx.log_table(rows, "curves")
    ctx.log_table(trans, "transitions")
    ctx.log_table(threshold_rows(plans, p.delta), "thresholds")
    ctx.log_table([{"metric": k, "value": v} for k, v in head.items()], "headline")
    ctx.log_figure(plot_metric(rows, plans, "exact", "signal", "P(exact recovery)"), "exact_vs_signal")
    ctx.log_figure(plot_metric(rows, plans, "fnr", "signal_mt", "FNR (solid), FDR (dashed)", hline=p.q,
                               dashed="fdr"), "fdr_fnr_vs_signal")
    fig = plot_collapse(rows, plans, p.selectors)
    if fig is not None:
        ctx.log_figure(fig, "collapse")
    return head


run_spam_select.check = check  # type: ignore[attr-defined]
