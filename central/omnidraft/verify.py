"""Verification in the target vocabulary: lossless speculative sampling and greedy verification.

``p`` holds the target's next-token distributions at the m proposal positions and one more (the
bonus position).  Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) accepts proposal
tᵢ with probability min(1, p(tᵢ)/q′(tᵢ)); at the first rejection it samples from the normalised
residual (p − q̃)₊, where q̃ is the proposal distribution over the target vocabulary at that position;
when all m are accepted it samples a bonus token from p.  A position whose draft token had no target
translation (``tail="reject"``) is a proposal of "nothing" (a symbol the target gives probability 0):
always rejected, so the token comes from the residual, which keeps the rule exact.  Greedy
verification accepts tᵢ iff it is the target's argmax and emits the argmax at the first mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def verify_sample(p: torch.Tensor, proposals: list[int], qprime: list[float], qres: list[torch.Tensor],
                  tail: str, gen: torch.Generator) -> Verdict:
    """Lossless speculative sampling over ``len(proposals)`` proposals.

    ``qres[i]`` is the proposal distribution over the target vocabulary at position i (used for the
    residual); it has one more entry than ``proposals`` when ``tail == "reject"``.
    """
    probs = acceptance_probs(p, proposals, qprime)
    for i, a in enumerate(probs):
        if float(torch.rand((), generator=gen)) >= a:
            return Verdict(i, _draw(residual(p[i], qres[i]), gen), tuple(probs))
    m = len(proposals)
    last = residual(p[m], qres[m]) if tail == "reject" else p[m]
    return Verdict(m, _draw(last, gen), tuple(probs))


def verify_greedy(p: torch.Tensor, proposals: list[int]) -> Verdict:
    """Accept while the proposal is the target's argmax; then emit the argmax."""
    best = p.argmax(dim=-1).tolist()
    flags = tuple(float(t == best[i]) for i, t in enumerate(proposals))
    for i, t in enumerate(proposals):
        if t != best[i]:
            return Verdict(i, best[i], flags)
    return Verdict(len(proposals), best[len(proposals)], flags)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs.double(), 1, generator=gen))


__all__ = ["Verdict", "verify_sample", "verify_greedy", "residual", "acceptance_probs"]
