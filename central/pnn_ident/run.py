"""The ``pnn_ident`` centralised method: verdict table, degree thresholds and weight recovery.

One run:

1. **Verdicts** — for every architecture of the chosen families (plus ``architectures``) × degree ×
   bias setting: #params, symmetry dimension, ambient and expected dimension, the exact (F_p)
   Jacobian rank, the verdict, the verdicts of its two-layer blocks, the Kruskal-type sufficient
   condition and (for small degrees) the float64 rank with its spectral gap.
2. **Degree thresholds** — for width patterns with one free width ``w`` (e.g. ``2-w-2``), the
   smallest r at which the network becomes identifiable, beside the counting lower bound and the
   Kruskal-type upper bound; the slope of the threshold in w.
3. **Recovery** — fit identifiable and defective networks from their values and compare with the
   truth up to the symmetries.

The headline ``claims/held_frac`` is the fraction of checked claim instances that held: localisation
(whole verdict = AND of block verdicts, networks with L ≥ 3), Kruskal ⇒ identifiable, identifiable ⇒
the counting condition holds for the network and its blocks, the pyramidal regime, float64 =
exact where float is reliable, counting ≤ threshold ≤ Kruskal, and recovery (unique iff identifiable).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsim.contracts.central import CentralContext
from central.pnn_ident.dimension import Verdict, blocks, counts_ok, expected_dim, kruskal, symmetry_dim, verdict
from central.pnn_ident.jacobian import exact_rank, float_rank
from central.pnn_ident.pnn import MAX_PRIME, Arch, ambient_dim, parse_widths
from central.pnn_ident.recover import Recovery, recover
from fedsim.errors import ConfigError
from fedsim.registry import CENTRAL

FAMILIES: dict[str, list[str]] = {
    # non-increasing widths (the paper: generically identifiable under mild conditions)
    "pyramidal": ["3-2-1", "3-2-2", "4-3-2", "4-3-2-1", "4-4-4", "3-3-3-3", "5-4-3-2", "3-2-2-2"],
    # a narrow code layer, then wider decoder layers (identifiable if the decoder does not grow too fast vs r)
    "encoder_decoder": ["4-2-4", "4-2-3-4", "4-2-4-4", "3-2-3-2", "5-3-5-5", "2-3-3-2"],
    # widening from the input
    "increasing": ["2-3-4", "2-4-2", "2-3-5", "2-4-6", "3-4-5"],
}


@dataclass
class PNNIdentParams:
    families: list[str] = field(default_factory=lambda: list(FAMILIES))  # built-in architecture lists
    architectures: list[str] = field(default_factory=list)  # extra widths "d0-d1-...-dL"
    degrees: list[int] = field(default_factory=lambda: [2, 3, 4, 5])  # activation x^r
    bias: list[bool] = field(default_factory=lambda: [False, True])    # without / with biases
    prime: int = 2_147_483_647   # F_p for the exact ranks (< 2^31: products fit in int64)
    trials: int = 2              # independent random points per exact rank (the max is used)
    float_max_degree: int = 9    # float64 cross-check only when D = r^{L−1} <= this ...
    float_max_params: int = 150  # ... and #params <= this
    float_rtol: float = 1.0e-8   # numerical rank: singular values > rtol · σ_max (columns normalised)
    float_min_gap: float = 3.0   # a float rank counts only with a gap of >= this many decades at the cut
    threshold_families: list[str] = field(default_factory=lambda: ["2-w-1", "2-w-2", "3-w-3", "4-2-w-4"])
    threshold_widths: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 6, 7])
    max_degree: int = 16         # search cap for the degree threshold
    recovery: list[str] = field(default_factory=lambda: ["3-2-1:3", "4-3-2:2", "4-3-2-1:3", "3-2-1:3:bias",
                                                         "3-2-1:2", "4-3-2-1:2", "3-2-1:2:bias"])
    restarts: int = 6            # random (global) initialisations per recovery case
    local_restarts: int = 2      # starts at truth + noise (probe the fibre through the truth)
    local_scale: float = 0.1     # relative size of that noise
    points_factor: int = 3       # fit on points_factor · #params points
    max_nfev: int = 1000         # Levenberg–Marquardt evaluations per restart
    fit_tol: float = 1.0e-8      # held-out relative residual below which a fit is exact
    match_tol: float = 1.0e-6    # canonical distance below which a fit equals the truth
    max_params: int = 400        # guard on the size of any network


# -- parsing and checks ----------------------------------------------------------------------------

def architectures(p: PNNIdentParams) -> list[tuple[str, tuple[int, ...]]]:
    """(family, widths) in table order, without duplicates."""
    seen: dict[tuple[int, ...], str] = {}
    for fam in p.families:
        for text in FAMILIES[fam]:
            seen.setdefault(parse_widths(text), fam)
    for text in p.architectures:
        seen.setdefault(parse_widths(text), "custom")
    return [(fam, w) for w, fam in seen.items()]


def parse_case(text: str) -> Arch:
    """``"3-2-1:3"`` or ``"3-2-1:3:bias"`` → Arch."""
    parts = str(text).split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "bias") or not parts[1].isdigit():
        raise ConfigError(f"bad recovery case {text!r}: write widths:r or widths:r:bias, e.g. 3-2-1:3")
    return Arch(parse_widths(parts[0]), int(parts[1]), len(parts) == 3)


def pattern_widths(pattern: str, w: int) -> tuple[int, ...]:
    return parse_widths("-".join(str(w) if part == "w" else part for part in pattern.split("-")))


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % k for k in range(2, int(n**0.5) + 1))


def check(p: PNNIdentParams) -> None:
    """One-line ConfigErrors for bad values (before any MLflow run starts)."""
    unknown = [f for f in p.families if f not in FAMILIES]
    if unknown:
        raise ConfigError(f"params.families: unknown {unknown}; choose among {', '.join(FAMILIES)}")
    if not p.families and not p.architectures:
        raise ConfigError("params.families and params.architectures are both empty: nothing to tabulate")
    if not p.degrees or min(p.degrees) < 2:
        raise ConfigError(f"params.degrees must be a non-empty list of integers >= 2 (x^1 is linear), got {p.degrees}")
    if not p.bias:
        raise ConfigError("params.bias must list at least one of false / true")
    if not _is_prime(p.prime) or not 1000 < p.prime < MAX_PRIME:
        raise ConfigError(f"params.prime must be a prime between 1000 and 2^31 (products fit in int64), got {p.prime}")
    if p.trials < 1 or p.restarts < 0 or p.local_restarts < 0 or p.points_factor < 1 or p.max_nfev < 1:
        raise ConfigError("params.trials, points_factor and max_nfev must be >= 1, restarts and local_restarts >= 0")
    if p.recovery and p.restarts + p.local_restarts < 1:
        raise ConfigError("params.recovery needs restarts + local_restarts >= 1")
    if not 0 < p.local_scale <= 10:
        raise ConfigError(f"params.local_scale must lie in (0, 10], got {p.local_scale}")
    if not 0 < p.float_rtol < 1 or p.float_min_gap < 0 or not 0 < p.fit_tol < 1 or not 0 < p.match_tol < 1:
        raise ConfigError("params.float_rtol, fit_tol and match_tol must lie in (0, 1) and float_min_gap >= 0")
    for pattern in p.threshold_families:
        if pattern.split("-").count("w") != 1:
            raise ConfigError(f"params.threshold_families: {pattern!r} must contain exactly one free width 'w', "
                              "e.g. 2-w-2")
    if p.threshold_families and (not p.threshold_widths or min(p.threshold_widths) < 1):
        raise ConfigError(f"params.threshold_widths must be integers >= 1, got {p.threshold_widths}")
    if p.max_degree < 2:
        raise ConfigError(f"params.max_degree must be >= 2, got {p.max_degree}")
    archs = [Arch(w, r, b) for _, w in architectures(p) for r in p.degrees for b in p.bias]
    archs += [Arch(pattern_widths(t, w), p.max_degree, b) for t in p.threshold_families
              for w in p.threshold_widths for b in p.bias]
    archs += [parse_case(c) for c in p.recovery]
    if any(a.r < 2 for a in archs):
        raise ConfigError("recovery cases need a degree r >= 2")
    big = [a.label for a in archs if a.n_params > p.max_params]
    if big:
        raise ConfigError(f"{big[0]} has more than params.max_params={p.max_params} parameters; shrink it")


# -- 1. verdicts -----------------------------------------------------------------------------------

@dataclass
class Cell:
    family: str
    arch: Arch
    verdict: Verdict
    ranks: list[int]
    block_verdicts: list[Verdict]
    kruskal_best: bool
    kruskal_nway: bool
    float_rank: int | None = None
    float_gap: float | None = None
    float_reliable: bool = False

    @property
    def localization_agrees(self) -> bool:
        return self.verdict.identifiable == all(v.identifiable for v in self.block_verdicts)

    @property
    def pyramidal_mild(self) -> bool:
        """Non-increasing widths with r >= 2, and r >= 3 when some block ends in width 1 [I: our reading]."""
        w = self.arch.widths
        return all(a >= b for a, b in zip(w, w[1:])) and (self.arch.r >= 3 or min(w[2:]) >= 2)


class RankCache:
    """Exact ranks, memoised per architecture (blocks recur across networks), seeded per architecture."""

    def __init__(self, ctx: CentralContext, p: PNNIdentParams) -> None:
        self.ctx, self.p = ctx, p
        self._ranks: dict[Arch, list[int]] = {}

    def ranks(self, arch: Arch) -> list[int]:
        if arch not in self._ranks:
            rng = self.ctx.rng("exact", arch.label)
            self._ranks[arch] = exact_rank(arch, rng, self.p.prime, self.p.trials)
        return self._ranks[arch]

    def verdict(self, arch: Arch) -> Verdict:
        return verdict(arch, max(self.ranks(arch)))


def make_cell(ctx: CentralContext, p: PNNIdentParams, cache: RankCache, family: str, arch: Arch) -> Cell:
    cell = Cell(family, arch, cache.verdict(arch), cache.ranks(arch), [cache.verdict(b) for b in blocks(arch)],
                kruskal(arch, best=True), kruskal(arch, best=False))
    if arch.degree <= p.float_max_degree and arch.n_params <= p.float_max_params:
        fr = float_rank(arch, ctx.rng("float", arch.label), p.float_rtol)
        cell.float_rank, cell.float_gap = fr.rank, fr.gap_decades
        cell.float_reliable = fr.reliable(p.float_min_gap)
    return cell


def cell_row(c: Cell) -> dict[str, Any]:
    a = c.arch
    return {"family": c.family, "widths": a.name, "r": a.r, "bias": a.bias, "L": a.L, "D": a.degree,
            "params": a.n_params, "sym_dim": symmetry_dim(a), "ambient": ambient_dim(a), "expected": expected_dim(a),
            "rank_exact": c.verdict.rank, "ranks_trials": "/".join(map(str, c.ranks)), "verdict": c.verdict.kind,
            "defect": c.verdict.defect, "fiber_dim": c.verdict.fiber_dim,
            "blocks": " ".join(v.short for v in c.block_verdicts), "blocks_all_identifiable":
            all(v.identifiable for v in c.block_verdicts), "localization_agrees": c.localization_agrees,
            "kruskal": c.kruskal_best, "kruskal_nway": c.kruskal_nway, "count_ok": counts_ok(a),
            "float_rank": "" if c.float_rank is None else c.float_rank,
            "float_gap_decades": "" if c.float_gap is None else round(min(c.float_gap, 99.0), 2),
            "float_reliable": c.float_reliable if c.float_rank is not None else ""}


def verdict_grid(cells: list[Cell], degrees: list[int]) -> list[dict[str, Any]]:
    """Architectures × degrees → verdict (I identifiable, D<k> defect k, F filling; blocks in brackets)."""
    rows: dict[tuple[str, bool], dict[str, Any]] = {}
    for c in cells:
        key = (c.arch.name, c.arch.bias)
        row = rows.setdefault(key, {"family": c.family, "widths": c.arch.name, "bias": c.arch.bias})
        blocks_txt = "" if c.arch.L == 2 else f" [{','.join(v.short for v in c.block_verdicts)}]"
        row[f"r={c.arch.r}"] = c.verdict.short + blocks_txt + (" K" if c.kruskal_best else "")
    return list(rows.values())


# -- 2. degree thresholds ---------------------------------------------------------------------------

@dataclass
class Threshold:
    pattern: str
    bias: bool
    w: int
    r_jacobian: int | None
    r_kruskal: int | None
    r_count: int | None

    @property
    def consistent(self) -> bool:
        """counting (necessary; network and blocks) ≤ observed ≤ Kruskal (sufficient), where defined."""
        if self.r_jacobian is None:
            return self.r_kruskal is None
        low = self.r_count is None or self.r_count <= self.r_jacobian
        high = self.r_kruskal is None or self.r_jacobian <= self.r_kruskal
        return low and high


def first_degree(pred: Any, max_degree: int) -> int | None:
    return next((r for r in range(2, max_degree + 1) if pred(r)), None)


def degree_threshold(cache: RankCache, pattern: str, w: int, bias: bool, max_degree: int) -> Threshold:
    widths = pattern_widths(pattern, w)
    return Threshold(pattern, bias, w,
                     first_degree(lambda r: cache.verdict(Arch(widths, r, bias)).identifiable, max_degree),
                     first_degree(lambda r: kruskal(Arch(widths, r, bias)), max_degree),
                     first_degree(lambda r: counts_ok(Arch(widths, r, bias)), max_degree))


def slope(ts: list[Threshold]) -> float:
    """Least-squares slope of r_jacobian in w (nan with fewer than two thresholds found)."""
    pts = [(t.w, t.r_jacobian) for t in ts if t.r_jacobian is not None]
    if len(pts) < 2:
        return float("nan")
    w, r = np.array(pts, dtype=float).T
    return float(np.polyfit(w, r, 1)[0])


# -- 3. recovery -------------------------------------------------------------------------------------

def recovery_row(rec: Recovery, identifiable: bool, p: PNNIdentParams) -> dict[str, Any]:
    errs = rec.exact_errors(p.fit_tol)
    n_exact, n_match = rec.n_exact(p.fit_tol), rec.n_match(p.fit_tol, p.match_tol)
    claim = n_exact > 0 and (n_match == n_exact if identifiable else n_match < n_exact)
    return {"case": rec.arch.label, "identifiable": identifiable,
            "exact_global": f"{rec.n_exact(p.fit_tol, 'global')}/{p.restarts}",
            "match_global": rec.n_match(p.fit_tol, p.match_tol, "global"),
            "exact_local": f"{rec.n_exact(p.fit_tol, 'local')}/{p.local_restarts}",
            "match_local": rec.n_match(p.fit_tol, p.match_tol, "local"),
            "min_err_exact": min(errs) if errs else "", "max_err_exact": max(errs) if errs else "",
            "spread_exact": rec.spread(p.fit_tol), "best_residual": min(rec.residuals) if rec.residuals else "",
            "claim_holds": claim}


# -- plots ---------------------------------------------------------------------------------------------

def plot_thresholds(ts: list[Threshold]) -> Any:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    patterns = list(dict.fromkeys(t.pattern for t in ts))
    biases = list(dict.fromkeys(t.bias for t in ts))
    fig, axes = plt.subplots(len(biases), len(patterns), figsize=(3.4 * len(patterns), 3.0 * len(biases)),
                             squeeze=False)
    for (i, bias), (j, pattern) in ((ib, jp) for ib in enumerate(biases) for jp in enumerate(patterns)):
        ax = axes[i][j]
        sel = [t for t in ts if (t.pattern, t.bias) == (pattern, bias)]
        for attr, style, size, label in [("r_jacobian", "o-", 8, "Jacobian rank (exact)"),
                                         ("r_kruskal", "s--", 5, "Kruskal-type sufficient"),
                                         ("r_count", "x:", 6, "counting necessary")]:
            pts = [(t.w, getattr(t, attr)) for t in sel if getattr(t, attr) is not None]
            if pts:
                ax.plot(*zip(*pts), style, markersize=size, label=label)
        ax.set_title(f"{pattern}{' +bias' if bias else ''}", fontsize=9)
        ax.set_xlabel("width w")
        ax.grid(alpha=0.3)
        if j == 0:
            ax.set_ylabel("smallest identifiable r")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Activation degree threshold vs width", fontsize=10)
    fig.tight_layout()
    return fig


def plot_verdicts(cells: list[Cell], degrees: list[int]) -> Any:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((c.arch.name, c.arch.bias) for c in cells))
    grid = np.full((len(keys), len(degrees)), np.nan)
    text: dict[tuple[int, int], str] = {}
    for c in cells:
        i, j = keys.index((c.arch.name, c.arch.bias)), degrees.index(c.arch.r)
        grid[i, j] = {"identifiable": 2, "filling": 1}.get(c.verdict.kind, 0)
        text[i, j] = c.verdict.short
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(degrees), 0.8 + 0.28 * len(keys)))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=2, aspect="auto")
    for (i, j), s in text.items():
        ax.text(j, i, s, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(degrees)), [f"r={r}" for r in degrees])
    ax.set_yticks(range(len(keys)), [f"{n}{' +b' if b else ''}" for n, b in keys], fontsize=7)
    ax.set_title("Verdict (I identifiable, Dk defect k, F filling)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_recovery(recs: list[tuple[Recovery, bool]], p: PNNIdentParams) -> Any:
    from fedsim.mpl import use_agg

    use_agg()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for rec, ident in recs:
        res = np.maximum(np.array(rec.residuals), 1e-17)
        err = np.maximum(np.array(rec.errors), 1e-17)
        ax.scatter(res, err, marker="o" if ident else "x", label=f"{rec.arch.label} ({'I' if ident else 'D'})", s=22)
    ax.axvline(p.fit_tol, color="grey", ls=":", lw=1)
    ax.axhline(p.match_tol, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("held-out relative residual of the fit")
    ax.set_ylabel("canonical distance to the truth")
    ax.set_title("Recovery up to scaling/permutation: exact fits (left of the line)", fontsize=9)
    ax.legend(fontsize=6, loc="center right")
    fig.tight_layout()
    return fig


# -- the method ------------------------------------------------------------------------------------

def _frac(flags: list[bool]) -> float:
    return float(np.mean(flags)) if flags else float("nan")


@CENTRAL.register("pnn_ident", params=PNNIdentParams,
                  summary="Identifiability of deep polynomial NNs (x^r): exact Jacobian ranks, blocks, thresholds, "
                          "recovery")
def run_pnn_ident(ctx: CentralContext) -> dict[str, float]:
    p: PNNIdentParams = ctx.params
    cache = RankCache(ctx, p)
    archs = [(fam, Arch(w, r, b)) for fam, w in architectures(p) for b in p.bias for r in p.degrees]
    with ctx.progress(len(archs), "verdicts") as bar:
        cells = []
        for fam, arch in archs:
            cells.append(make_cell(ctx, p, cache, fam, arch))
            bar.advance()
    ctx.log_table([cell_row(c) for c in cells], "verdicts")
    ctx.log_table(verdict_grid(cells, p.degrees), "verdict_grid")
    ctx.log_figure(plot_verdicts(cells, p.degrees), "verdicts")

    thresholds = [degree_threshold(cache, pat, w, b, p.max_degree)
                  for pat in p.threshold_families for b in p.bias for w in p.threshold_widths]
    if thresholds:
        ctx.log_table([t.__dict__ | {"consistent": t.consistent} for t in thresholds], "thresholds")
        ctx.log_figure(plot_thresholds(thresholds), "degree_threshold_vs_width")

    recs = []
    for case in p.recovery:
        arch = parse_case(case)
        recs.append((recover(arch, ctx.rng("recovery", case), p.restarts, p.local_restarts, p.local_scale,
                             p.points_factor, p.max_nfev), cache.verdict(arch).identifiable))
    rec_rows = [recovery_row(rec, ident, p) for rec, ident in recs]
    if recs:
        ctx.log_table(rec_rows, "recovery")
        ctx.log_figure(plot_recovery(recs, p), "recovery")

    deep = [c for c in cells if c.arch.L >= 3]  # for L = 2 the block is the network: nothing to check
    claims = ([c.localization_agrees for c in deep] + [c.verdict.identifiable for c in cells if c.kruskal_best]
              + [c.verdict.identifiable for c in cells if c.pyramidal_mild]
              + [counts_ok(c.arch) for c in cells if c.verdict.identifiable]
              + [c.float_rank == c.verdict.rank for c in cells if c.float_reliable]
              + [t.consistent for t in thresholds] + [bool(r["claim_holds"]) for r in rec_rows])
    metrics = {
        "claims/held_frac": _frac(claims),
        "claims/checked": float(len(claims)),
        "localization/agreement": _frac([c.localization_agrees for c in deep]),
        "localization/deep_cells": float(len(deep)),
        "kruskal/sound": _frac([c.verdict.identifiable for c in cells if c.kruskal_best]),
        "pyramidal/identifiable_frac_mild": _frac([c.verdict.identifiable for c in cells if c.pyramidal_mild]),
        "identifiable/frac": _frac([c.verdict.identifiable for c in cells]),
        "defective/frac": _frac([c.verdict.kind == "defective" for c in cells]),
        "float/agreement": _frac([c.float_rank == c.verdict.rank for c in cells if c.float_reliable]),
        "float/reliable_frac": _frac([c.float_reliable for c in cells if c.float_rank is not None]),
        "threshold/consistent": _frac([t.consistent for t in thresholds]),
    }
    for pat in p.threshold_families:
        for b in p.bias:
            metrics[f"threshold/slope/{pat}{'/bias' if b else ''}"] = slope(
                [t for t in thresholds if (t.pattern, t.bias) == (pat, b)])
    ident_rows = [r for r in rec_rows if r["identifiable"]]
    defect_rows = [r for r in rec_rows if not r["identifiable"]]
    metrics["recovery/unique_identifiable"] = _frac([bool(r["claim_holds"]) for r in ident_rows])
    metrics["recovery/nonunique_defective"] = _frac([bool(r["claim_holds"]) for r in defect_rows])
    if p.restarts:
        metrics["recovery/global_exact_frac_identifiable"] = _frac(
            [rec.n_exact(p.fit_tol, "global") / p.restarts for rec, ident in recs if ident])
    return {k: v for k, v in metrics.items() if not np.isnan(v)}


run_pnn_ident.check = check  # type: ignore[attr-defined]
