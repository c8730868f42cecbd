"""The four watermarks: keyed side information, watermarked sampling, per-token detection scores.

Every scheme draws its side information from a PRNG seeded by the key and the previous token (the
authors' ``markov_1`` context), samples the next token from a distribution ``P`` (one row per
sequence, all rows of a step at once) and scores a token sequence for detection:

* :class:`SimplexWater` / :class:`HeavyWater` — OT schemes: couple the top-p-filtered ``P`` with
  ``Unif(S)`` by entropic OT (:func:`sinkhorn_batch`), then sample ``x ~ π[:, s] / Σ_x π[x, s]``;
* :class:`RedGreen` — Kirchenbauer et al.: add ``δ`` to the logits of a keyed ``γ``-fraction;
* :class:`Gumbel` — Aaronson: ``x = argmax_x r_x^(1/p_x)`` for keyed uniforms ``r``.

Detection: a per-token score (:meth:`Scheme.token_scores`), summed over the first ``T`` tokens,
turned into a z-score and a one-sided p-value (:meth:`Scheme.z`, :meth:`Scheme.pvalue`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from scipy import stats

from fedsim.threads import torch_threads

SCHEMES = ("simplex", "heavy", "redgreen", "gumbel")


@dataclass(frozen=True)
class SchemeConfig:
    """Knobs shared by the schemes (defaults: the authors' code and the baselines' papers)."""

    top_p: float = 0.999
    reg: float = 0.05
    max_iter: int = 2000
    stop_thr: float = 1e-5
    tilt: float = 0.0
    heavy_side: int = 1024
    gamma: float = 0.5
    delta: float = 2.0
    dtype: str = "float64"  # of the Sinkhorn iterations ("float32": about 2x faster, same iteration counts)
    chunk_elements: int = 4_000_000  # entries of one shared Sinkhorn kernel (memory bound)


# ------------------------------------------------------------------------------------------------
# keyed side information
# ------------------------------------------------------------------------------------------------
def context_rng(key: int, prev: int) -> np.random.Generator:
    """The PRNG of one context: seeded by a hash (SeedSequence) of the key and the previous token."""
    return np.random.default_rng([key, int(prev)])


class ContextCache:
    """Side information per previous token, computed once per context (bounded LRU cache)."""

    def __init__(self, key: int, draw: Callable[[np.random.Generator], np.ndarray], max_elements: int = 1 << 24):
        self.key, self.draw = key, draw
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._max_elements = max_elements

    def row(self, prev: int) -> np.ndarray:
        prev = int(prev)
        row = self._rows.get(prev)
        if row is None:
            row = self._rows[prev] = self.draw(context_rng(self.key, prev))
            while len(self._rows) > 1 and len(self._rows) * row.size > self._max_elements:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(prev)
        return row

    def rows(self, prev: np.ndarray) -> np.ndarray:
        """Stacked side information for an array of previous tokens."""
        return np.stack([self.row(p) for p in np.asarray(prev).ravel()]).reshape(*np.shape(prev), -1)

    def values_at(self, prev: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``row(prev)[x]`` elementwise (vector side information), grouped by distinct context."""
        prev, x = np.asarray(prev).ravel(), np.asarray(x).ravel()
        uniq, inverse = np.unique(prev, return_inverse=True)
        out = np.empty(prev.shape, dtype=self.row(int(uniq[0])).dtype) if len(uniq) else np.empty(0)
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(uniq) + 1))
        for j, p in enumerate(uniq):
            sel = order[bounds[j] : bounds[j + 1]]
            out[sel] = self.row(int(p))[x[sel]]
        return out


# ------------------------------------------------------------------------------------------------
# top-p and batched Sinkhorn
# ------------------------------------------------------------------------------------------------
def top_p_support(P: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row's smallest most-likely set with mass >= ``top_p`` (the authors' ``top_p_indices``).

    Returns ``idx`` (N, k) token ids sorted by probability and ``a`` (N, k) the renormalised
    probabilities, zero-padded where a row keeps fewer than ``k`` tokens.
    """
    order = np.argsort(-P, axis=1, kind="stable")
    sorted_p = np.take_along_axis(P, order, axis=1)
    keep = np.minimum((np.cumsum(sorted_p, axis=1) < top_p).sum(axis=1) + 1, P.shape[1])
    k = int(keep.max())
    a = sorted_p[:, :k] * (np.arange(k)[None, :] < keep[:, None])
    return order[:, :k], a / a.sum(axis=1, keepdims=True)


def sinkhorn_batch(A: torch.Tensor, K: torch.Tensor, stop_thr: float, max_iter: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """POT's ``sinkhorn_knopp`` for a batch of problems sharing one kernel, marginals A and Unif(S).

    ``A`` (n, m) holds each problem's marginal over the m kernel rows (zero outside its support),
    ``K`` (m, S) is ``exp(-M / reg)``.  Same initialisation (uniform on the support), update order
    (``v`` then ``u``), error (the L2 violation of the ``Unif(S)`` marginal, every 10th iteration)
    and stopping rule as ``ot.sinkhorn(a, b, M, reg, numItermax=max_iter, stopThr=stop_thr)`` run
    on each problem's support alone (zero rows add exact zeros), but batched as matrix products and
    each problem stops on its own.  Returns ``u`` (n, m), ``v`` (n, S) and POT's ``niter`` per problem.
    """
    n, S = A.shape[0], K.shape[1]
    b = 1.0 / S
    support = (A > 0).to(A.dtype)
    u = support / support.sum(1, keepdim=True)
    v = torch.full((n, S), b, dtype=A.dtype)
    Kt = K.T.contiguous()
    u_out, v_out = torch.zeros_like(u), torch.zeros_like(v)
    iters = torch.full((n,), max_iter, dtype=torch.long)
    active = torch.arange(n)
    ktu = u @ K
    for it in range(max_iter):
        v_new = b / ktu
        u_new = A / (v_new @ Kt)
        bad = ~(torch.isfinite(u_new).all(1) & torch.isfinite(v_new).all(1) & (ktu > 0).all(1))
        if bad.any():  # machine precision reached: keep the previous iterate (as POT does)
            u_new[bad], v_new[bad] = u[bad], v[bad]
        u, v = u_new, v_new
        ktu = u @ K  # the next iteration's K^T u, and the marginal check's
        done = bad
        if it % 10 == 0:
            done = done | (torch.linalg.vector_norm(v * ktu - b, dim=1) < stop_thr)
        if done.any():
            u_out[active[done]], v_out[active[done]], iters[active[done]] = u[done], v[done], it
            keep = ~done
            active, A, u, v, ktu = active[keep], A[keep], u[keep], v[keep], ktu[keep]
            if len(active) == 0:
                break
    if len(active):
        u_out[active], v_out[active] = u, v
    return u_out, v_out, iters


def union_chunks(idx: np.ndarray, a: np.ndarray, width: int, budget: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows grouped so that (size of the union of their supports) × width <= budget (>= 1 row each);
    returns (rows, sorted union of token ids) per group."""
    chunks: list[tuple[np.ndarray, np.ndarray]] = []
    rows: list[int] = []
    union = np.empty(0, dtype=idx.dtype)
    for i in range(len(idx)):
        grown = np.union1d(union, idx[i][a[i] > 0])
        if rows and len(grown) * width > budget:
            chunks.append((np.asarray(rows), union))
            rows, grown = [], np.unique(idx[i][a[i] > 0])
        rows.append(i)
        union = grown
    chunks.append((np.asarray(rows), union))
    return chunks


@dataclass
class Coupling:
    """The OT couplings of a batch of distributions: support ``idx``, marginal ``a``, scaling ``u``.

    ``π[x, s] = u_x K[x, s] v_s``; only ``u`` is kept since ``π[:, s] / Σ_x π[x, s]`` does not
    depend on ``v``.  ``average`` (optional) is the exact mean over ``s`` of the conditionals.
    """

    idx: np.ndarray
    a: np.ndarray
    u: np.ndarray
    iters: np.ndarray
    average: np.ndarray | None = None

    def take(self, rows: np.ndarray) -> "Coupling":
        avg = None if self.average is None else self.average[rows]
        return Coupling(self.idx[rows], self.a[rows], self.u[rows], self.iters[rows], avg)


# ------------------------------------------------------------------------------------------------
# schemes
# ------------------------------------------------------------------------------------------------
class Scheme(ABC):
    """Common interface: sample one token per row of ``P`` given the previous tokens; score tokens."""

    name = ""

    def __init__(self, vocab: int, key: int, cfg: SchemeConfig) -> None:
        self.vocab, self.key, self.cfg = vocab, key, cfg

    @abstractmethod
    def sample(self, P: np.ndarray, prev: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One watermarked token per row of the next-token distributions ``P``."""

    @abstractmethod
    def token_scores(self, tokens: np.ndarray, prev: np.ndarray) -> np.ndarray:
        """Per-token detection scores, shape of ``tokens`` (``prev``: the token before each)."""

    @abstractmethod
    def z(self, total: np.ndarray, T: int | np.ndarray) -> np.ndarray:
        """The detection statistic of a summed score over ``T`` tokens."""

    def pvalue(self, total: np.ndarray, T: int | np.ndarray) -> np.ndarray:
        return stats.norm.sf(self.z(total, T))


def _sample_rows(w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row of non-negative weights ``w`` (inverse CDF)."""
    cdf = np.cumsum(w, axis=1)
    u = rng.random(len(w))[:, None] * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=1), w.shape[1] - 1)


class OTScheme(Scheme):
    """Sampling through the entropic OT coupling of top-p(P) with Unif(S) (both new schemes)."""

    side_size = 0
    _tilt_cut = 0.5  # the tilt raises π(x, s) where f(x, s) > this

    def __init__(self, vocab: int, key: int, cfg: SchemeConfig) -> None:
        super().__init__(vocab, key, cfg)
        self._side = ContextCache(key, lambda rng: np.array([rng.integers(1, self.side_size + 1)]))

    # -- the score f(x, s) and the OT cost -----------------------------------------------------------
    @abstractmethod
    def score(self, x: np.ndarray, s: np.ndarray) -> np.ndarray:
        """f(x, s) elementwise (broadcasting), s in 1..S."""

    @abstractmethod
    def cost(self, f: np.ndarray) -> np.ndarray:
        """The OT cost matrix from the score table ``f``."""

    def side(self, prev: np.ndarray) -> np.ndarray:
        """s in 1..S for each previous token (same shape as ``prev``)."""
        uniq, inverse = np.unique(np.asarray(prev), return_inverse=True)
        values = np.array([self._side.row(int(p))[0] for p in uniq], dtype=np.int64)
        return values[inverse].reshape(np.shape(prev))

    def _tilt(self, f: np.ndarray) -> np.ndarray:
        """The authors' optional tilt: π(x, s)·(1+δ) where f(x, s) "is 1", ·(1−δ) elsewhere."""
        return np.where(f > self._tilt_cut, 1.0 + self.cfg.tilt, 1.0 - self.cfg.tilt)

    # -- coupling, conditional sampling, exact average -----------------------------------------------
    def couple(self, P: np.ndarray, with_average: bool = False) -> Coupling:
        """Sinkhorn couplings of every row of ``P`` (top-p filtered), batched over shared kernels."""
        idx, a = top_p_support(P, self.cfg.top_p)
        u, iters = np.zeros(a.shape), np.zeros(len(a), dtype=np.int64)
        average = np.zeros(a.shape) if with_average else None
        with torch_threads(1):
            for rows, union in union_chunks(idx, a, self.side_size, self.cfg.chunk_elements):
                pos = np.minimum(np.searchsorted(union, idx[rows]), len(union) - 1)
                on_support = a[rows] > 0
                r, j = np.nonzero(on_support)
                A = np.zeros((len(rows), len(union)))
                A[r, pos[r, j]] = a[rows][r, j]
                K = torch.from_numpy(self._kernel(union))
                u_c, _, it = sinkhorn_batch(torch.from_numpy(A).to(K.dtype), K, self.cfg.stop_thr, self.cfg.max_iter)
                u[rows] = np.where(on_support, np.take_along_axis(u_c.double().numpy(), pos, axis=1), 0.0)
                iters[rows] = it.numpy()
                if average is not None:
                    avg = self._average(union, u_c, K).double().numpy()
                    average[rows] = np.where(on_support, np.take_along_axis(avg, pos, axis=1), 0.0)
        if average is not None:
            with np.errstate(invalid="ignore", divide="ignore"):
                average = average / average.sum(axis=1, keepdims=True)  # float32 rounding
        return Coupling(idx, a, u, iters, average)

    def _kernel(self, tokens: np.ndarray) -> np.ndarray:
        """exp(-M / reg) for the given token rows, (len(tokens), S), in the Sinkhorn dtype."""
        s = np.arange(1, self.side_size + 1)
        return np.exp(-self.cost(self.score(tokens[:, None], s[None, :])) / self.cfg.reg).astype(self.cfg.dtype)

    def _average(self, tokens: np.ndarray, u: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
        """Exact mean over s ~ Unif(S) of the (tilted) conditionals π[:, s] / Σ_x π[x, s]:
        u ⊙ (K (1 / (Kᵀu))) / S."""
        if self.cfg.tilt:
            s = np.arange(1, self.side_size + 1)
            K = K * torch.from_numpy(self._tilt(self.score(tokens[:, None], s[None, :]))).to(K.dtype)
        return u * ((1.0 / (u @ K)) @ K.T) / K.shape[1]

    def conditional(self, c: Coupling, s: np.ndarray) -> np.ndarray:
        """The sampling weights over each row's support given side information ``s`` (N,)."""
        f = self.score(c.idx, s[:, None])
        w = c.u * np.exp(-self.cost(f) / self.cfg.reg)
        if self.cfg.tilt:
            w = w * self._tilt(f)
        total = w.sum(axis=1, keepdims=True)
        ok = np.isfinite(total) & (total > 0)  # a kernel that underflowed entirely: sample from P
        return np.where(ok, w / np.where(ok, total, 1.0), c.a)

    def sample_coupled(self, c: Coupling, prev: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        w = self.conditional(c, self.side(prev))
        return c.idx[np.arange(len(w)), _sample_rows(w, rng)]

    def sample(self, P: np.ndarray, prev: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return self.sample_coupled(self.couple(P), prev, rng)

    def token_scores(self, tokens: np.ndarray, prev: np.ndarray) -> np.ndarray:
        return self.score(np.asarray(tokens), self.side(prev)).astype(np.float64)


class SimplexWater(OTScheme):
    """Binary simplex code: f(x, s) = <bin(x), bin(s)> mod 2, s in 1..2^n−1, n = ⌈log2 V⌉; cost 1 − f."""

    name = "simplex"

    def __init__(self, vocab: int, key: int, cfg: SchemeConfig) -> None:
        self.bits = max(1, math.ceil(math.log2(vocab)))
        self.side_size = 2**self.bits - 1
        super().__init__(vocab, key, cfg)

    def score(self, x: np.ndarray, s: np.ndarray) -> np.ndarray:
        word = np.uint16 if self.bits <= 16 else np.uint32  # small words: large vocabularies make big tables
        return np.bitwise_count(np.bitwise_and(np.asarray(x).astype(word), np.asarray(s).astype(word))) & 1

    def cost(self, f: np.ndarray) -> np.ndarray:
        return 1.0 - f

    def _kernel(self, tokens: np.ndarray) -> np.ndarray:
        """exp(-(1 - f)/reg) takes two values: built from f directly (no float64 temporaries)."""
        f = self.score(tokens[:, None], np.arange(1, self.side_size + 1)[None, :])
        dtype = np.dtype(self.cfg.dtype)
        return np.where(f == 1, dtype.type(1.0), dtype.type(math.exp(-1.0 / self.cfg.reg)))

    def z(self, total: np.ndarray, T: int | np.ndarray) -> np.ndarray:
        return (np.asarray(total) - np.asarray(T) / 2) / np.sqrt(np.asarray(T) / 4)


def heavy_table(vocab: int, side: int, key: int) -> np.ndarray:
    """Keyed i.i.d. lognormal(0, 1) scores, each token row standardised to mean 0 and variance 1."""
    raw = np.random.default_rng([key, 0x4EA7]).lognormal(0.0, 1.0, size=(vocab, side))
    return (raw - raw.mean(axis=1, keepdims=True)) / raw.std(axis=1, keepdims=True)


class HeavyWater(OTScheme):
    """Heavy-tailed scores f(x, s) ~ standardised lognormal, s in 1..1024; cost (max f − f)/10."""

    name = "heavy"
    _tilt_cut = 0.0  # a continuous score: tilt up where f > 0 (see the module docstring)

    def __init__(self, vocab: int, key: int, cfg: SchemeConfig) -> None:
        self.side_size = cfg.heavy_side
        self.table = heavy_table(vocab, cfg.heavy_side, key)
        self._shift = float(self.table.max())
        super().__init__(vocab, key, cfg)

    def score(self, x: np.ndarray, s: np.ndarray) -> np.ndarray:
        return self.table[np.asarray(x), np.asarray(s) - 1]

    def cost(self, f: np.ndarray) -> np.ndarray:
        return (self._shift - f) / 10.0

    def z(self, total: np.ndarray, T: int | np.ndarray) -> np.ndarray:
        return np.asarray(total) / np.sqrt(T)

    def pvalue_mc(self, tokens: np.ndarray, scores: np.ndarray, Ts: list[int], draws: int,
                  rng: np.random.Generator, mask: np.ndarray | None = None) -> np.ndarray:
        """Monte-Carlo p-values (N, len(Ts)) of Σ_{t<=T} f given the tokens, s_t i.i.d. Unif(S) under H0.

        ``scores`` are the observed per-token scores (``mask``: the positions that count).  The
        authors' normal p-value ignores the lognormal skew (anti-conservative for small T); this one
        is exact up to Monte-Carlo error: (1 + #{null sums >= observed}) / (1 + draws).
        """
        tokens, T_max, cols = np.asarray(tokens), max(Ts), np.asarray(Ts) - 1
        weight = np.ones(tokens.shape) if mask is None else mask.astype(np.float64)
        observed = np.cumsum((scores * weight)[:, :T_max], axis=1)[:, cols]
        out = np.empty((len(tokens), len(Ts)))
        for i, row in enumerate(tokens[:, :T_max]):
            null = self.table[row[None, :], rng.integers(0, self.side_size, size=(draws, T_max))]
            null = np.cumsum(null * weight[i, :T_max], axis=1)[:, cols]
            out[i] = (1 + (null >= observed[i][None, :] - 1e-9).sum(axis=0)) / (1 + draws)
        return out


class RedGreen(Scheme):
    """Kirchenbauer et al.: a keyed γ-fraction green list per context, +δ on green logits; z-test."""

    name = "redgreen"

    def __init__(self, vocab: int, key: int, cfg: SchemeConfig) -> None:
        super().__init__(vocab, key, cfg)
        self.green_size = int(vocab * cfg.gamma)
        self._green = ContextCache(key, self._draw_green)

    def _draw_green(self, rng: np.random.Generator) -> np.ndarray:
        mask = np.zeros(self.vocab, dtype=bool)
        mask[rng.permutation(self.vocab)[: self.green_size]] = True
        return mask

    def tilted(self, P: np.ndarray, green: np.ndarray) -> np.ndarray:
        w = P * np.exp(self.cfg.delta * green)
        return w / w.sum(axis=-1, keepdims=True)

    def sample(self, P: np.ndarray, prev: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _sample_rows(self.tilted(P, self._green.rows(prev)), rng)

    def average(self, P: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
        """Monte-Carlo mean of the sampling distribution over ``draws`` random green lists."""
        greens = np.stack([self._draw_green(rng) for _ in range(draws)])
        return np.stack([self.tilted(p[None, :], greens).mean(axis=0) for p in P])

    def token_scores(self, tokens: np.ndarray, prev: np.ndarray) -> np.ndarray:
        return self._green.values_at(prev, tokens).reshape(np.shape(tokens)).astype(np.float64)

    def z(self, total: np.ndarray, T: int | np.ndarray) -> np.ndarray:
        g = self.green_size / self.vocab
        return (np.asarray(total) - g * np.asarray(T)) / np.sqrt(np.asarray(T) * g * (1 - g))


class Gumbel(Scheme):
    """Aaronson: x = argmax r_x^(1/p_x) over top-p(P) for keyed uniforms r; score −log(1 − r_x)."""

    name = "gumbel"

    def __init__(self, vocab: int, key: int, cfg: SchemeConfig) -> None:
        super().__init__(vocab, key, cfg)
        self._r = ContextCache(key, lambda rng: rng.random(self.vocab))

    def filtered(self, P: np.ndarray) -> np.ndarray:
        idx, a = top_p_support(P, self.cfg.top_p)
        out = np.zeros_like(P)
        np.put_along_axis(out, idx, a, axis=1)
        return out

    def sample(self, P: np.ndarray, prev: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        p = self.filtered(P)
        with np.errstate(divide="ignore"):
            return np.argmax(np.log(self._r.rows(prev)) / p, axis=1)

    def average(self, P: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
        """Rao-Blackwellised Monte-Carlo mean of the sampling distribution over ``draws`` uniforms r.

        Given r_{-x}, x wins with probability 1 − exp(p_x · max_{y≠x} log(r_y)/p_y); averaging that
        (instead of 0/1 wins) gives a smooth, unbiased estimate with no empty cells.
        """
        p = self.filtered(P)
        out = np.empty_like(p)
        for i, row in enumerate(p):
            r = rng.random((draws, self.vocab))
            with np.errstate(divide="ignore"):
                g = np.where(row > 0, np.log(r) / np.where(row > 0, row, 1.0), -np.inf)
            top2 = -np.partition(-g, 1, axis=1)[:, :2]
            best = g.argmax(axis=1)
            other = np.where(np.arange(self.vocab)[None, :] == best[:, None], top2[:, 1:2], top2[:, 0:1])
            win = np.where(row > 0, -np.expm1(row * other), 0.0)
            est = win.mean(axis=0)
            out[i] = est / est.sum()
        return out

    def token_scores(self, tokens: np.ndarray, prev: np.ndarray) -> np.ndarray:
        r = self._r.values_at(prev, tokens).reshape(np.shape(tokens))
        return -np.log(np.clip(1.0 - r, 1e-10, None))

    def z(self, total: np.ndarray, T: int | np.ndarray) -> np.ndarray:
        return (np.asarray(total) - np.asarray(T)) / np.sqrt(T)

    def pvalue(self, total: np.ndarray, T: int | np.ndarray) -> np.ndarray:
        """Exact: Σ −log(1 − r) ~ Gamma(T, 1) under H0."""
        return stats.gamma.sf(np.asarray(total), T)


def first_occurrences(tokens: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """Mask (N, T) of the positions whose (previous token, token) pair is new in its sequence.

    Scoring only those (``dedup``) keeps repeated contexts from counting the same score twice.
    """
    pairs = np.asarray(prev, np.int64) * (int(np.max(tokens)) + 1) + np.asarray(tokens, np.int64)
    mask = np.zeros(pairs.shape, dtype=bool)
    for i, row in enumerate(pairs):
        mask[i, np.unique(row, return_index=True)[1]] = True
    return mask


CLASSES: dict[str, type[Scheme]] = {"simplex": SimplexWater, "heavy": HeavyWater, "redgreen": RedGreen,
                                    "gumbel": Gumbel}


def make_scheme(name: str, vocab: int, key: int, cfg: SchemeConfig) -> Scheme:
    return CLASSES[name](vocab, key, cfg)


def kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(p ‖ q) per row (0 log 0 = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
    return terms.sum(axis=-1)


def tv(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return 0.5 * np.abs(p - q).sum(axis=-1)
