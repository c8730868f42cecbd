"""Losslessness checks: greedy token equality, and the first emitted token's distribution (chi-square)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats as st

from central.omnidraft.decode import Draft, SpecDecoder, probs
from central.omnidraft.vocab import translate


@dataclass(frozen=True)
class DistCheck:
    samples: int
    pvalue: float
    tv: float  # total variation between the empirical distribution and p
    bins: int


@torch.no_grad()
def first_token_samples(dec: SpecDecoder, prompt: list[int], prompt_text: str, n: int, gen: torch.Generator,
                        chunk: int = 500) -> tuple[list[int], torch.Tensor]:
    """``n`` independent draws of the first emitted token of a speculative block after ``prompt``.

    Each draw samples k draft tokens from the variant's drafter (batched: its state as it is now,
    without the acceptance head, whose stop rule only shortens the draft), translates them with the
    variant's n-gram cache, and verifies the first proposal with the decoder's own rule.  Returns the
    draws and the target's p at that position.
    """
    p = probs(dec.target.model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1], dec.cfg.temperature)
    context = dec.bridge.encode_text(prompt_text)
    out: list[int] = []
    while len(out) < n:
        b = min(chunk, n - len(out))
        tokens, q_rows = _draft_batch(dec, context, b, gen)
        for row in range(b):
            draft = Draft(tokens[row].tolist(), list(q_rows[row]))
            props, stuck = translate(draft.tokens, dec.bridge, dec.cache)
            verdict = dec.verify(p.expand(2, -1), p.expand(2, -1), props[:1], draft, stuck and not props, gen,
                                   greedy=False)
            out.append(props[0].target if props and verdict.accepted else verdict.token)
    return out, p


def _draft_batch(dec: SpecDecoder, context: list[int], b: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import DynamicCache

    model = dec.drafter.model
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([context] * b), cache=cache, use_cache=True).logits[:, -1]
    tokens, qs = [], []
    for j in range(dec.cfg.k):
        q = probs(logits, dec.cfg.temperature)
        token = torch.multinomial(q, 1, generator=gen)
        tokens.append(token)
        qs.append(q)
        if j < dec.cfg.k - 1:
            logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(tokens, dim=1), torch.stack(qs, dim=1)


def chi_square(draws: list[int], p: torch.Tensor, min_expected: float = 5.0) -> DistCheck:
    """Pearson's test of the draws against p; tokens with expected count < ``min_expected`` are pooled."""
    n = len(draws)
    expected = p.double().numpy() * n
    observed = np.bincount(np.asarray(draws), minlength=len(expected)).astype(float)
    big = expected >= min_expected
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < min_expected:  # pool the rest into the smallest kept bin
        obs, exp = obs[:-1], exp[:-1]
        if len(obs):
            obs[np.argmin(exp)] += observed[~big].sum()
            exp[np.argmin(exp)] += expected[~big].sum()
    pvalue = float(st.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue) if len(obs) > 1 else 1.0
    tv = 0.5 * float(np.abs(observed / n - p.double().numpy()).sum())
    return DistCheck(n, pvalue, tv, len(obs))


def greedy_identical(spec: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of prompts whose speculative output equals target-only greedy decoding token for token."""
    return float(np.mean([a == b for a, b in zip(spec, reference)])) if spec else float("nan")


__all__ = ["first_token_samples", "chi_square", "greedy_identical", "DistCheck"]
