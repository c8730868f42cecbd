"""Powered exactness test of OmniDraft's speculative sampling (issue #26).

The real decoder (``SpecDecoder.generate``: exact walk, acceptance ratio, residual, cache fill, online
updates, head stops) runs on the toy world of :mod:`central.omnidraft.checks` (table models, nested
cache keys, two paths to one target token, an untranslatable draft token).  For every variant,
20,000 generations of 3 tokens after a fixed prompt; positions 1, 2, 3 (10 bins) and the pair (1, 2)
(up to 100 bins) are chi-square tested against the exact distributions, with a TV bound on the
marginals.  The negative control (the pre-fix sampler: greedy longest match, q′ = ∏q, estimated
residual) must fail on the same world.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from central.omnidraft.checks import (TOY_KEYS, LegacyToyDecoder, ToyBridge, ToyDecoder, chi_square, position_checks,
                                      toy_draws, toy_world)
from central.omnidraft.exact import draft_exact, mass, walk
from central.omnidraft.vocab import NgramCache

DRAWS = 20_000


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world():
    return toy_world(0)


_DRAWS: dict[str, np.ndarray] = {}


@pytest.mark.parametrize("letter", ["a", "b", "c", "d"])
def test_speculative_sampling_is_exact_at_three_positions(world, letter) -> None:
    dec = ToyDecoder(letter, world)
    draws = _DRAWS[letter] = toy_draws(dec, DRAWS, torch.Generator().manual_seed(11 + ord(letter)))
    checks = position_checks(draws, world)
    for pos, c in checks.items():
        assert c.pvalue > 1e-3, f"variant {letter}, position {pos}: p = {c.pvalue:.2e}, TV = {c.tv:.4f}"
        if "," not in pos:
            assert c.tv < 0.02, f"variant {letter}, position {pos}: TV = {c.tv:.4f}"
    if letter != "a":  # the merged paths were exercised: merged target tokens were proposed and accepted
        assert dec.cache is not None and sum(dec.cache.hits.values()) > 1000


def test_negative_control_the_old_single_path_sampler_fails(world) -> None:
    draws = toy_draws(LegacyToyDecoder("b", world), 5_000, torch.Generator().manual_seed(5))
    checks = position_checks(draws, world)
    assert checks["1"].pvalue < 1e-6 and checks["1,2"].pvalue < 1e-6, {k: c.pvalue for k, c in checks.items()}


def test_the_test_has_power_against_a_slightly_wrong_target(world) -> None:
    """The exact sampler's draws against a target 3% off (mixed with uniform) must be rejected."""
    draws = _DRAWS.get("b")
    if draws is None:
        draws = toy_draws(ToyDecoder("b", world), DRAWS, torch.Generator().manual_seed(2))
    exact = world.exact()["1"]
    off = 0.97 * exact + 0.03 / len(exact)
    assert chi_square(draws[:, 0], off).pvalue < 1e-6


def test_walk_marginal_sums_every_path_and_matches_enumeration() -> None:
    """Q(t|s) from `mass` equals the walk's proposal frequencies, computed by exhaustive enumeration."""
    bridge, cache = ToyBridge(), NgramCache(3)
    for t, key in TOY_KEYS:
        cache.add(t, key)
    g = np.random.default_rng(3)
    table = g.dirichlet(np.ones(8), size=8).tolist()

    def row(prefix):
        return table[prefix[-1] if prefix else 5]

    exact = {t: mass(t, (), row, bridge, cache) for t in range(10)}
    import itertools

    freq: dict[object, float] = {}
    seen: set[tuple] = set()
    for seq in itertools.product(range(8), repeat=4):  # keys are <= 3 long: a walk samples <= 4 tokens
        it, prob = iter(seq), [1.0]

        def sample(q):
            x = next(it)
            prob[0] *= q[x]
            return x

        t, path, n = walk(row, sample, (), bridge, cache)
        if seq[:n] not in seen:  # each outcome (the sampled tokens) once
            seen.add(seq[:n])
            freq[t] = freq.get(t, 0.0) + prob[0]
    assert sum(freq.values()) == pytest.approx(1.0)
    assert exact[6] > row(())[6] > 0  # two paths to 6: the direct twin and the key (2, 4)
    for t in range(10):
        assert freq.get(t, 0.0) == pytest.approx(exact[t], abs=1e-12), t
    assert freq[None] > 0  # ⊥: draft 7 alone, or a walk that fell off the trie


def test_budget_and_head_stops_come_between_walks() -> None:
    bridge, cache = ToyBridge(), NgramCache(3)
    for t, key in TOY_KEYS:
        cache.add(t, key)
    script = iter([4, 0, 1, 2, 5])  # direct 4, then the key (0, 1, 2): the walk may overrun k = 2

    out = draft_exact(lambda p: [1.0 / 8] * 8, lambda q: next(script), 2, bridge, cache)
    assert [(p.target, p.start, p.n) for p in out.props] == [(4, 0, 1), (8, 1, 3)] and len(out.tokens) == 4
    script = iter([4, 0, 1, 2])
    out = draft_exact(lambda p: [1.0 / 8] * 8, lambda q: next(script), 6, bridge, cache, stop=lambda s: True)
    assert [(p.target, p.n) for p in out.props] == [(4, 1)] and out.head_stop
    # (3,) starts the key (3, 7, 7): after 3 the walk looks one token ahead and discards it
    script = iter([3, 0, 1, 2])
    out = draft_exact(lambda p: [1.0 / 8] * 8, lambda q: next(script), 2, bridge, cache)
    assert [(p.target, p.start, p.n) for p in out.props] == [(3, 0, 1), (1, 1, 1)] and out.sampled == 4
