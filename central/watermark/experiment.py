"""The two test beds and the detection analysis.

* synthetic distribution streams: pools of Dirichlet next-token distributions binned by entropy;
  a sequence draws a fresh pool member at every step, and its side information comes from the
  token it generated before (as in real text);
* real generations: a causal LM continues held-out code prompts, watermarked at every step;
* :func:`detection_curves`: TPR at a fixed FPR against the number of scored tokens, with the
  threshold taken from unwatermarked sequences scored with the same key.  The test is randomised
  at the threshold (ours; a standard Neyman–Pearson test): a score equal to it counts as detected
  with the probability that brings the calibration null to exactly α, and rates are expectations
  over that coin.  Without it, schemes whose scores take few values (Red-Green, SimplexWater: sums
  of {0, 1} or of a few OT values) were compared at a held-out FPR well below α (SimplexWater 0.74%
  at [0.05, 0.3) nats against HeavyWater's 1.41%), which biased the TPR comparison against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from central.watermark.schemes import (Coupling, Gumbel, HeavyWater, OTScheme, RedGreen, Scheme, first_occurrences, kl,
                                       tv)
from fedsim.threads import torch_threads


def entropy(P: np.ndarray) -> np.ndarray:
    """Shannon entropy (nats) per row."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(P > 0, P * np.log(P), 0.0).sum(axis=-1)


# ------------------------------------------------------------------------------------------------
# synthetic streams
# ------------------------------------------------------------------------------------------------
def dirichlet_pool(rng: np.random.Generator, vocab: int, low: float, high: float, size: int,
                   max_draws: int = 2_000_000) -> np.ndarray:
    """``size`` Dirichlet(α·1) distributions over ``vocab`` tokens with entropy in [low, high) nats.

    α is drawn log-uniformly in [1e-3, 1] for every candidate, so the pool covers the bin evenly
    enough; candidates outside the bin are rejected.  Raises ValueError if the bin stays unfilled.
    """
    kept: list[np.ndarray] = []
    have, drawn = 0, 0
    while have < size and drawn < max_draws:
        alpha = np.exp(rng.uniform(np.log(1e-3), 0.0, size=4096))
        gam = rng.gamma(alpha[:, None], size=(4096, vocab))
        with np.errstate(invalid="ignore", divide="ignore"):  # all-zero draws (tiny α) are dropped below
            P = gam / gam.sum(axis=1, keepdims=True)
        ok = np.isfinite(P).all(axis=1)
        H = entropy(np.where(ok[:, None], P, 0.0))
        sel = ok & (H >= low) & (H < high)
        kept.append(P[sel])
        have, drawn = have + int(sel.sum()), drawn + 4096
    if have < size:
        raise ValueError(f"could not fill the entropy bin [{low}, {high}) nats over {vocab} tokens")
    return np.concatenate(kept)[:size]


@dataclass
class Streams:
    """Generated sequences: tokens (N, T), the token before each (N, T) and per-step diagnostics."""

    tokens: np.ndarray
    prev: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)


def synthetic_streams(scheme: Scheme | None, pool: np.ndarray, coupling: Coupling | None, n: int, steps: int,
                      rng: np.random.Generator) -> Streams:
    """``n`` sequences of ``steps`` tokens; step t samples from a random pool member (watermarked
    by ``scheme`` given the previous token, or plainly when ``scheme`` is None)."""
    vocab = pool.shape[1]
    prev = rng.integers(0, vocab, size=n)
    tokens, prevs = np.empty((n, steps), np.int64), np.empty((n, steps), np.int64)
    for t in range(steps):
        j = rng.integers(0, len(pool), size=n)
        if scheme is None:
            cdf = np.cumsum(pool[j], axis=1)
            x = np.minimum((cdf <= rng.random(n)[:, None] * cdf[:, -1:]).sum(axis=1), vocab - 1)
        elif isinstance(scheme, OTScheme) and coupling is not None:
            x = scheme.sample_coupled(coupling.take(j), prev, rng)
        else:
            x = scheme.sample(pool[j], prev, rng)
        tokens[:, t], prevs[:, t], prev = x, prev, x
    return Streams(tokens, prevs)


def pool_distortion(scheme: Scheme, pool: np.ndarray, coupling: Coupling | None, draws: int,
                    rng: np.random.Generator) -> dict[str, float]:
    """KL(P ‖ P̂) and TV(P, P̂) of the average sampling distribution P̂ over the side information.

    P is the distribution the scheme samples from: top-p(P) for the OT schemes and Gumbel, the full
    P for Red-Green.  P̂ is exact for the OT schemes (mean over all s), Monte-Carlo over ``draws``
    keyed draws for Red-Green and (Rao-Blackwellised) for Gumbel.
    """
    if isinstance(scheme, OTScheme):
        assert coupling is not None and coupling.average is not None
        base, avg = coupling.a, coupling.average
    elif isinstance(scheme, Gumbel):
        base, avg = scheme.filtered(pool), scheme.average(pool, draws, rng)
    else:
        assert isinstance(scheme, RedGreen)
        base, avg = pool, scheme.average(pool, draws, rng)
    k, d = kl(base, avg), tv(base, avg)
    return {"kl_mean": float(k.mean()), "kl_max": float(k.max()), "tv_mean": float(d.mean()), "tv_max": float(d.max())}


# ------------------------------------------------------------------------------------------------
# real generations
# ------------------------------------------------------------------------------------------------
Picker = Callable[[np.ndarray, np.ndarray], np.ndarray]


def plain_picker(rng: np.random.Generator) -> Picker:
    """Unwatermarked multinomial sampling."""

    def pick(P: np.ndarray, prev: np.ndarray) -> np.ndarray:
        cdf = np.cumsum(P, axis=1)
        return np.minimum((cdf <= rng.random(len(P))[:, None] * cdf[:, -1:]).sum(axis=1), P.shape[1] - 1)

    return pick


def scheme_picker(scheme: Scheme, rng: np.random.Generator, log: dict[str, list[np.ndarray]]) -> Picker:
    """Watermarked sampling; the OT schemes also log the per-step KL(P ‖ P̂) and Sinkhorn iterations."""

    def pick(P: np.ndarray, prev: np.ndarray) -> np.ndarray:
        if isinstance(scheme, OTScheme):
            c = scheme.couple(P, with_average=True)
            assert c.average is not None
            log.setdefault("kl", []).append(kl(c.a, c.average))
            log.setdefault("iters", []).append(c.iters.astype(float))
            return scheme.sample_coupled(c, prev, rng)
        return scheme.sample(P, prev, rng)

    return pick


def lm_streams(model: Any, prompts: torch.Tensor, steps: int, pick: Picker, temperature: float,
               batch: int = 64, on_step: Callable[[int], None] | None = None) -> Streams:
    """Continue every prompt (N, L) by ``steps`` tokens chosen by ``pick`` from the model's
    next-token distribution at ``temperature``; records the model's NLL (temperature 1) of each
    chosen token and the entropy of each sampling distribution."""
    n = len(prompts)
    tokens, prevs = np.empty((n, steps), np.int64), np.empty((n, steps), np.int64)
    nll, ent = np.empty((n, steps)), np.empty((n, steps))
    with torch_threads(1):
        _generate(model, prompts, steps, pick, temperature, batch, on_step, tokens, prevs, nll, ent)
    return Streams(tokens, prevs, {"nll": nll, "entropy": ent})


@torch.no_grad()
def _generate(model: Any, prompts: torch.Tensor, steps: int, pick: Picker, temperature: float, batch: int,
              on_step: Callable[[int], None] | None, tokens: np.ndarray, prevs: np.ndarray, nll: np.ndarray,
              ent: np.ndarray) -> None:
    n = len(prompts)
    for lo in range(0, n, batch):
        rows = slice(lo, min(n, lo + batch))
        out = model(input_ids=prompts[rows], use_cache=True)
        prev = prompts[rows, -1].numpy()
        for t in range(steps):
            logits = out.logits[:, -1].double()
            logp = torch.log_softmax(logits, dim=-1)
            P = torch.softmax(logits / temperature, dim=-1).numpy()
            x = pick(P, prev)
            nll[rows, t] = -logp[torch.arange(len(x)), torch.from_numpy(x)].numpy()
            ent[rows, t] = entropy(P)
            tokens[rows, t], prevs[rows, t], prev = x, prev, x
            out = model(input_ids=torch.from_numpy(x)[:, None], cache=out.cache, use_cache=True)
            if on_step is not None:
                on_step(len(x))


def repetition(s: Streams) -> dict[str, float]:
    """How often generated text repeats its (previous token, token) pairs, and perplexity without the repeats.

    * ``repeated_pairs``: the share of positions whose pair already occurred earlier in the same
      sequence (the scores a per-token detector counts more than once);
    * ``distinct_2``: distinct pairs / all pairs over all the sequences together (distinct-2 of Li et
      al. 2016; it falls with the number and length of the sequences, so compare equal-sized sets);
    * ``ppl_first_pairs`` (with the model's NLL in ``s.extra``): perplexity over the first
      occurrences only, so text that loops on cheap repeats does not look more fluent.
    """
    mask = first_occurrences(s.tokens, s.prev)
    pairs = np.asarray(s.prev, np.int64) * (int(np.max(s.tokens)) + 1) + np.asarray(s.tokens, np.int64)
    out = {"repeated_pairs": float(1.0 - mask.mean()), "distinct_2": float(len(np.unique(pairs)) / pairs.size)}
    if "nll" in s.extra:
        out["ppl_first_pairs"] = float(np.exp(s.extra["nll"][mask].mean()))
    return out


def prompt_windows(ids: torch.Tensor, n: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    """``n`` random windows of ``length`` consecutive token ids."""
    if len(ids) <= length:
        raise ValueError(f"the held-out text has only {len(ids)} tokens, fewer than a {length}-token prompt")
    starts = rng.integers(0, len(ids) - length, size=n)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


# ------------------------------------------------------------------------------------------------
# detection analysis
# ------------------------------------------------------------------------------------------------
@dataclass
class Detection:
    """TPR against T (1..T_max) at the empirical threshold, and the FPR checks at given Ts."""

    tpr: np.ndarray                       # (T_max,)
    threshold: np.ndarray                 # (T_max,) z-threshold from the calibration half of the null
    fpr_heldout: np.ndarray               # (T_max,) FPR of that threshold on the other half
    fpr_nominal: dict[int, float]         # T -> FPR of "p-value <= α" on all null sequences
    fpr_normal: dict[int, float] = field(default_factory=dict)  # HeavyWater: the authors' normal p-value

    def tokens_to(self, level: float) -> float:
        """The fewest tokens at which TPR >= level (T_max + 1 if never)."""
        hit = np.nonzero(self.tpr >= level)[0]
        return float(hit[0] + 1) if len(hit) else float(len(self.tpr) + 1)


def empirical_threshold(null_z: np.ndarray, alpha: float) -> np.ndarray:
    """Per column, the value c with at most ⌊α·n⌋ null values strictly above it."""
    n = len(null_z)
    m = int(np.floor(alpha * n))
    return np.sort(null_z, axis=0)[n - m - 1]


def tie_probability(null_z: np.ndarray, threshold: np.ndarray, alpha: float) -> np.ndarray:
    """Per column, γ in [0, 1] with #(null > c) + γ·#(null = c) = α·n: the randomised test's coin at c."""
    above = (null_z > threshold).sum(axis=0)
    at = (null_z == threshold).sum(axis=0)
    return np.clip((alpha * len(null_z) - above) / np.maximum(at, 1), 0.0, 1.0)


def detection_rate(z: np.ndarray, threshold: np.ndarray, gamma: np.ndarray) -> np.ndarray:
    """Per column, the expected fraction of ``z`` the randomised test detects: P(z > c) + γ·P(z = c)."""
    return (z > threshold).mean(axis=0) + gamma * (z == threshold).mean(axis=0)


@dataclass
class Scored:
    """A scheme's scores of some sequences: per token, cumulative totals, cumulative counts, z."""

    scores: np.ndarray
    total: np.ndarray
    count: np.ndarray
    z: np.ndarray
    mask: np.ndarray | None


def score_streams(scheme: Scheme, s: Streams, dedup: bool) -> Scored:
    """Score ``s`` with the scheme's key; ``dedup`` counts each (previous token, token) pair once
    per sequence (then T is the number of scored pairs so far)."""
    scores = scheme.token_scores(s.tokens, s.prev)
    mask = first_occurrences(s.tokens, s.prev) if dedup else None
    if mask is None:
        total, count = np.cumsum(scores, axis=1), np.broadcast_to(np.arange(1, scores.shape[1] + 1), scores.shape)
    else:
        total, count = np.cumsum(scores * mask, axis=1), np.cumsum(mask, axis=1)
    return Scored(scores, total, count, scheme.z(total, count), mask)


def detection_curves(scheme: Scheme, wm: Streams, null: Streams, alpha: float, Ts: list[int],
                     rng: np.random.Generator, mc_draws: int, dedup: bool = False) -> Detection:
    """Score watermarked and null sequences with the scheme's key; thresholds from half the null."""
    z_wm = score_streams(scheme, wm, dedup).z
    n = score_streams(scheme, null, dedup)
    order = rng.permutation(len(n.z))
    calib, held = order[: len(order) // 2], order[len(order) // 2 :]
    thr = empirical_threshold(n.z[calib], alpha)
    gamma = tie_probability(n.z[calib], thr, alpha)
    det = Detection(tpr=detection_rate(z_wm, thr, gamma), threshold=thr,
                    fpr_heldout=detection_rate(n.z[held], thr, gamma), fpr_nominal={})
    p_mc = None
    if isinstance(scheme, HeavyWater):
        p_mc = scheme.pvalue_mc(null.tokens, n.scores, Ts, mc_draws, rng, n.mask)
    for i, T in enumerate(Ts):
        p = scheme.pvalue(n.total[:, T - 1], n.count[:, T - 1])
        if p_mc is not None:  # HeavyWater: the exact p-value; the authors' normal one reported apart
            det.fpr_nominal[T], det.fpr_normal[T] = float((p_mc[:, i] <= alpha).mean()), float((p <= alpha).mean())
        else:
            det.fpr_nominal[T] = float((p <= alpha).mean())
    return det
