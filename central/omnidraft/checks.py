"""Losslessness checks: greedy token equality, and a powered exactness test of speculative sampling.

The sampling check runs the decoder's own code (:meth:`SpecDecoder.generate`, its exact walk,
acceptance ratio and residual, cache fill, online updates and head stops) on a **toy world** whose
target and drafter are probability tables, so the exact output distribution is known in closed
form and tens of thousands of generations take seconds: 8 draft tokens (one untranslatable), 10
target tokens, bigram target and drafter, and an n-gram cache with nested keys ((0,1) and
(0,1,2)), a key through an untranslatable draft token, a target with two keys, and a target with
both a direct twin and a key (two paths to one token).  Each draw generates 3 tokens after a fixed
prompt; positions 1, 2, 3 (marginals, 10 bins) and the pair (1, 2) (100 bins) are tested by Pearson's
chi-square against the exact distributions, with the empirical total variation.  The negative control
runs the pre-fix sampler (greedy longest-match translation, single-path q′ = ∏q, estimated residual)
on the same world; it must fail.

Variants on the toy: (a) no cache; (b) the cache (filled online too); (c) + a drafter table that
changes after every block (as online distillation changes the drafter); (d) + a head that stops the
draft between proposals, with a rule that changes online.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats as st

from central.omnidraft.decode import VARIANTS, CachedLM, DecodeConfig, Draft, SpecDecoder
from central.omnidraft.exact import Path
from central.omnidraft.verify import sample_index, verify_sample
from central.omnidraft.vocab import NgramCache, Proposal, proposal_q, residual_q, translate


@dataclass(frozen=True)
class DistCheck:
    samples: int
    pvalue: float
    tv: float  # total variation between the empirical distribution and p
    bins: int


def chi_square(draws: list[int] | np.ndarray, p: torch.Tensor | np.ndarray, min_expected: float = 5.0) -> DistCheck:
    """Pearson's test of the draws against p; tokens with expected count < ``min_expected`` are pooled."""
    p = np.asarray(p, dtype=float).ravel()
    n = len(draws)
    expected = p * n
    observed = np.bincount(np.asarray(draws, dtype=int), minlength=len(expected)).astype(float)
    big = expected >= min_expected
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < min_expected:  # pool the rest into the smallest kept bin
        obs, exp = obs[:-1], exp[:-1]
        if len(obs):
            obs[np.argmin(exp)] += observed[~big].sum()
            exp[np.argmin(exp)] += expected[~big].sum()
    pvalue = float(st.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue) if len(obs) > 1 else 1.0
    tv = 0.5 * float(np.abs(observed / n - p).sum())
    return DistCheck(n, pvalue, tv, len(obs))


def greedy_identical(spec: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of prompts whose speculative output equals target-only greedy decoding token for token."""
    return float(np.mean([a == b for a, b in zip(spec, reference)])) if spec else float("nan")


# -- the toy world -------------------------------------------------------------------------------------

DRAFT_VOCAB, TARGET_VOCAB = 8, 10
TOY_D2T = [0, 1, 2, 3, 4, 5, 6, -1]  # draft 7 has no target twin
TOY_SPELLING = {**{t: (t,) for t in range(7)}, 7: (0, 1), 8: (0, 1, 2), 9: (1, 3)}
TOY_KEYS = [(7, (0, 1)), (8, (0, 1, 2)), (9, (1, 3)), (6, (2, 4)), (8, (3, 7, 7))]
PROMPT_TARGET, PROMPT_DRAFT = [2, 5], [2, 5]


@dataclass
class ToyBridge:
    """The parts of :class:`VocabBridge` the decoder uses, for table models (1 byte per token)."""

    d2t: torch.Tensor = field(default_factory=lambda: torch.tensor(TOY_D2T))
    spellings: dict[int, Path] = field(default_factory=lambda: dict(TOY_SPELLING))
    draft_vocab: int = DRAFT_VOCAB
    target_vocab: int = TARGET_VOCAB

    t2d: dict[int, int] = field(default_factory=lambda: {t: d for d, t in enumerate(TOY_D2T) if t >= 0})

    def spelling(self, t: int) -> Path:
        return self.spellings[t]

    def encode_text(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def target_text(self, ids: list[int]) -> bytes:
        return b"x" * len(ids)


@dataclass
class ToyWorld:
    target: torch.Tensor  # (V, V): p(next | last target token)
    drafter: torch.Tensor  # (D, D): q(next | last draft token)
    emb: torch.Tensor  # (D, 3): the drafter's "hidden state" after a token (head features)

    def exact(self) -> dict[str, np.ndarray]:
        """The exact distributions of positions 1, 2, 3 and of the pair (1, 2) after the prompt."""
        P = self.target.numpy()
        p1 = P[PROMPT_TARGET[-1]]
        return {"1": p1, "2": p1 @ P, "3": p1 @ P @ P, "1,2": (p1[:, None] * P).ravel()}


def toy_world(seed: int = 0) -> ToyWorld:
    g = np.random.default_rng(seed)
    q = g.dirichlet(np.full(DRAFT_VOCAB, 0.7), size=DRAFT_VOCAB)
    q[:, 0] += 0.35  # runs that merge: 0→1(→2), 1→3, 2→4, 3→7→7
    q[0, 1] += 1.2
    q[1, 2] += 0.5
    q[1, 3] += 0.6
    q[2, 4] += 0.8
    q[3, 7] += 0.5
    q[7, 7] += 0.5
    q /= q.sum(1, keepdims=True)
    p = g.dirichlet(np.full(TARGET_VOCAB, 0.8), size=TARGET_VOCAB)
    p[:, 7:] += 0.15  # the target likes the merged tokens
    p /= p.sum(1, keepdims=True)
    return ToyWorld(torch.tensor(p), torch.tensor(q), torch.tensor(g.normal(size=(DRAFT_VOCAB, 3))))


class ToyRows:
    """The drafter's rows for a block: q(·|last draft token of context + prefix), hidden = emb[that token]."""

    def __init__(self, table: list[list[float]], emb: torch.Tensor, context: list[int]) -> None:
        self.table, self.emb, self.last = table, emb, context[-1]  # rows as Python lists: fast to index

    def _tok(self, prefix: Path) -> int:
        return prefix[-1] if prefix else self.last

    def __call__(self, prefix: Path) -> list[float]:
        return self.table[self._tok(prefix)]

    def hidden_at(self, prefix: Path) -> torch.Tensor:
        return self.emb[self._tok(prefix)]


class ToyDistiller:
    """Stands in for online distillation: the drafter table moves after every block."""

    def __init__(self, dec: "ToyDecoder", seed: int) -> None:
        self.dec, self.losses = dec, []
        self.noise = torch.tensor(np.random.default_rng(seed).dirichlet(np.ones(DRAFT_VOCAB), size=(7, DRAFT_VOCAB)))

    def update(self, context: list[int], items: list) -> float:
        i = len(self.losses) % len(self.noise)
        self.dec.table = (0.5 * self.dec.world.drafter + 0.5 * self.noise[i]).tolist()
        self.losses.append(float(i))
        return self.losses[-1]


class ToyHead:
    """Stands in for the acceptance head: P(accept) from the hidden state, with a bias learned online."""

    def __init__(self) -> None:
        self.w = torch.tensor([0.8, -0.6, 0.5], dtype=torch.float64)
        self.bias, self.x, self.y = 0.0, [], []

    def features(self, hidden: torch.Tensor, q: torch.Tensor, token: int) -> torch.Tensor:
        return hidden

    def prob(self, feats: torch.Tensor) -> float:
        return float(torch.sigmoid(feats @ self.w + self.bias))

    def update(self, feats: list[torch.Tensor], labels: list[float]) -> None:
        if labels:
            self.bias = 0.9 * self.bias + 0.1 * (2.0 * float(np.mean(labels)) - 1.0)


class ToyDecoder(SpecDecoder):
    """The real decoder with table models: only the two model calls are replaced."""

    def __init__(self, letter: str, world: ToyWorld, k: int = 4, seed: int = 0) -> None:
        variant = VARIANTS[letter]
        cfg = DecodeConfig(k=k, greedy=False, temperature=1.0, head_threshold=0.4)
        super().__init__(variant, torch.nn.Identity(), torch.nn.Identity(), ToyBridge(), cfg, set(), ngram_max=3)
        self.target, self.drafter = CachedLM(torch.nn.Identity()), CachedLM(torch.nn.Identity())
        self.world, self.table = world, world.drafter.tolist()
        self.log_target = world.target.log()
        if self.cache is not None:
            for t, key in TOY_KEYS:
                self.cache.add(t, key)
        if variant.distill:
            self.distiller = ToyDistiller(self, seed)
        if variant.head:
            self.head = ToyHead()  # type: ignore[assignment]

    def _target_logits(self, ids: list[int], m: int) -> torch.Tensor:
        return self.log_target[torch.tensor(ids[-(m + 1):])]

    def _rows(self, context: list[int]) -> ToyRows:  # type: ignore[override]
        return ToyRows(self.table, self.world.emb, context)


class LegacyToyDecoder(ToyDecoder):
    """The pre-fix sampler (negative control): greedy longest match, q′ = ∏q, the estimated residual."""

    def draft_sampling(self, context: list[int], gen: torch.Generator,
                       max_props: int | None = None) -> tuple[Draft, list[Proposal], bool]:
        rows, tokens, qs = self._rows(context), [], []
        for _ in range(self.cfg.k):
            q = torch.tensor(rows(tuple(tokens)), dtype=torch.float64)
            tokens.append(sample_index(q, gen))
            qs.append(q)
        props, stuck = translate(tokens, self.bridge, self.cache)
        return Draft(tokens, qs), props, stuck

    def verify(self, p, logits, props, draft, stuck, gen, greedy=None):
        q_rows = torch.stack(draft.q)
        qprime = [proposal_q(q_rows, draft.tokens, pr) for pr in props]
        qres = [residual_q(draft.q[pr.start], self.bridge,
                           (pr.target, int(self.bridge.d2t[draft.tokens[pr.start]]), qp) if pr.merged else None)
                for pr, qp in zip(props, qprime)]
        if stuck:
            qres.append(residual_q(draft.q[sum(pr.n for pr in props)], self.bridge))
        return verify_sample(p, [pr.target for pr in props], qprime, qres, "reject" if stuck else "bonus", gen)


def toy_draws(dec: ToyDecoder, n: int, gen: torch.Generator, positions: int = 3) -> np.ndarray:
    """``n`` generations of ``positions`` tokens after the fixed prompt, with the decoder's state carried on."""
    out = np.empty((n, positions), dtype=np.int64)
    text = " ".join(map(str, PROMPT_DRAFT))
    for i in range(n):
        tokens, _ = dec.generate(list(PROMPT_TARGET), text, positions, gen)
        out[i] = tokens[:positions]
    return out


def position_checks(draws: np.ndarray, world: ToyWorld) -> dict[str, DistCheck]:
    exact = world.exact()
    cols = {"1": draws[:, 0], "2": draws[:, 1], "3": draws[:, 2], "1,2": draws[:, 0] * TARGET_VOCAB + draws[:, 1]}
    return {pos: chi_square(cols[pos], exact[pos]) for pos in exact}


def exactness_check(n: int = 20_000, seed: int = 0, variants: str = "abcd", control: bool = True,
                    k: int = 4, world_seed: int = 0) -> list[dict]:
    """Rows (sampler, variant, position, samples, bins, chi2_pvalue, tv) for every variant and position.

    ``seed`` seeds the draws; the toy world is fixed (``world_seed``).  The exact sampler should give
    p > 1e-3 everywhere and TV within sampling noise (≈ 0.01 for 20,000 draws over 10 bins); the
    control (``sampler`` = "old single-path q", variant b) p < 1e-6.
    """
    world, rows = toy_world(world_seed), []
    runs = [("exact", v, ToyDecoder) for v in variants] + ([("old single-path q", "b", LegacyToyDecoder)] if control else [])
    for j, (sampler, v, cls) in enumerate(runs):
        dec = cls(v, world, k=k, seed=seed)
        draws = toy_draws(dec, n, torch.Generator().manual_seed(seed * 7919 + j))
        for pos, c in position_checks(draws, world).items():
            rows.append({"sampler": sampler, "variant": v, "position": pos, "samples": c.samples, "bins": c.bins,
                         "chi2_pvalue": c.pvalue, "tv": c.tv})
    return rows


__all__ = ["chi_square", "greedy_identical", "DistCheck", "exactness_check", "toy_world", "ToyDecoder",
           "LegacyToyDecoder", "toy_draws", "position_checks"]
