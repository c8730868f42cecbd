"""Verification in the target vocabulary: lossless speculative sampling and greedy verification.

``p`` holds the target's next-token distributions at the m proposal positions and one more (the
bonus position).  Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) accepts proposal
tᵢ with probability min(1, p(tᵢ)/q′(tᵢ)); at the first rejection it samples from the normalised
residual (p − q̃)₊, where q̃ is the proposal distribution over the target vocabulary at that position;
when all m are accepted it samples a bonus token from p.  A position whose draft token had no target
translation (``tail="reject"``) is a proposal of "nothing" (a symbol the target gives probability 0):
always rejected, so the token comes from the residual, which keeps the rule exact.  The residual's Q
is either a vector or a function t ↦ Q(t) (:mod:`central.omnidraft.exact`: with an n-gram cache only
point values are cheap); then the residual is drawn by rejection — y ~ p, kept with probability
max(0, 1 − Q(y)/p(y)) — which needs Q at the drawn points only and costs one draw per position on
average (the rejection happens with probability TV(p, Q), and takes 1/TV draws).  Greedy
verification accepts tᵢ iff it is the target's argmax and emits the argmax at the first mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

QRes = Union[torch.Tensor, Callable[[int], float]]
RESIDUAL_CAP = 100_000  # rejection draws before falling back to p: a bias of at most 1/(e·cap) ≈ 4e-6


@dataclass(frozen=True)
class Verdict:
    """``accepted`` proposals were accepted, then ``token`` was emitted (correction or bonus)."""

    accepted: int
    token: int
    accept_probs: tuple[float, ...]  # min(1, p/q′) (sampling) or 1[tᵢ = argmax] (greedy), per proposal


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The normalised (p − q)₊ (p itself when p ≤ q everywhere, which can only happen up to rounding)."""
    r = (p - q).clamp(min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


def acceptance_probs(p: torch.Tensor, proposals: list[int], qprime: list[float]) -> list[float]:
    """min(1, p(tᵢ)/q′(tᵢ)) for every proposal (the conditional acceptance probability)."""
    return [min(1.0, float(p[i, t]) / q) if q > 0 else 1.0 for i, (t, q) in enumerate(zip(proposals, qprime))]


def draw_residual(p: torch.Tensor, q: QRes, gen: torch.Generator, cap: int = RESIDUAL_CAP) -> int:
    """One draw from the normalised (p − Q)₊; ``q`` a vector, or a function t ↦ Q(t) (then by rejection)."""
    if isinstance(q, torch.Tensor):
        return _draw(residual(p, q), gen)
    for _ in range(cap):
        y = _draw(p, gen)
        py = float(p[y])
        if float(torch.rand((), generator=gen)) * py < py - q(y):  # keep with probability max(0, 1 − Q/p)
            return y
    return _draw(p, gen)  # only when Σ(p − Q)₊ is ~0 (rounding)


def verify_sample(p: torch.Tensor, proposals: list[int], qprime: list[float], qres: list[QRes],
                  tail: str, gen: torch.Generator) -> Verdict:
    """Lossless speculative sampling over ``len(proposals)`` proposals.

    ``qprime[i]`` must be Q(tᵢ), the exact probability that position i's proposal procedure yields tᵢ
    (summed over every path to it); ``qres[i]`` is that whole distribution Q over the target
    vocabulary (a vector or t ↦ Q(t)), used for the residual; it has one more entry than
    ``proposals`` when ``tail == "reject"``.
    """
    probs = acceptance_probs(p, proposals, qprime)
    for i, a in enumerate(probs):
        if float(torch.rand((), generator=gen)) >= a:
            return Verdict(i, draw_residual(p[i], qres[i], gen), tuple(probs))
    m = len(proposals)
    token = draw_residual(p[m], qres[m], gen) if tail == "reject" else _draw(p[m], gen)
    return Verdict(m, token, tuple(probs))


def verify_greedy(p: torch.Tensor, proposals: list[int]) -> Verdict:
    """Accept while the proposal is the target's argmax; then emit the argmax."""
    best = p.argmax(dim=-1).tolist()
    flags = tuple(float(t == best[i]) for i, t in enumerate(proposals))
    for i, t in enumerate(proposals):
        if t != best[i]:
            return Verdict(i, best[i], flags)
    return Verdict(len(proposals), best[len(proposals)], flags)


def sample_index(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One index drawn with probability ∝ ``probs`` (inverse CDF: one uniform; far cheaper than
    ``torch.multinomial`` on small vectors, and a zero-probability index is never drawn)."""
    u = float(torch.rand((), dtype=torch.float64, generator=gen))
    if isinstance(probs, list) or len(probs) <= 64:  # small vectors (the toy check): a Python scan
        values = probs if isinstance(probs, list) else probs.tolist()
        u *= sum(values)
        acc = 0.0
        for i, x in enumerate(values):
            acc += x
            if u < acc:
                return i
        return max(i for i, x in enumerate(values) if x > 0)
    c = probs.double().cumsum(0)
    return min(int(torch.searchsorted(c, u * c[-1], right=True)), len(c) - 1)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    return sample_index(probs, gen)


__all__ = ["Verdict", "verify_sample", "verify_greedy", "residual", "draw_residual", "acceptance_probs", "sample_index"]
