"""Exact cross-vocabulary proposals for speculative sampling: a translation whose marginal is path-local.

Why the greedy translation cannot be used for sampling
------------------------------------------------------
Speculative sampling is exact only when the acceptance ratio min(1, p(t)/Q(t)) and the residual
(p − Q)₊ use Q = the probability with which the *whole proposal procedure* (drafter + translation)
proposes target token t at that position, summed over every path that yields t.  Under greedy
longest-match translation (:func:`central.omnidraft.vocab.translate`) a direct proposal d→t is made
only when the continuation did *not* complete a cache entry starting with d, so Q(t) = q(d)·P(no
merge | d) — a sum over the whole cache sub-trie below d, i.e. drafter distributions on branches that
were never sampled — and the token that broke the match is reused as the next proposal's first draft
token, so the next position's proposal distribution is conditioned on "not that continuation".  The
old code used the single-path q′ = q(d) or ∏q(d_j) and an estimated residual: not exact (issue #26).

The exact rule used for sampling (``walk``)
--------------------------------------------
From a drafter state s, walk the cache trie (every non-empty prefix of a key is a node; a *terminal*
is a key, or a single draft token with a direct image):

* sample x ~ q(·|s+path); if path+x is a trie node, extend (a leaf is a key: commit it);
* else, if ``path`` is empty: propose the direct image of x (⊥ if it has none; x is consumed);
* else, if ``path`` is a terminal: commit it and **discard x** (the next walk samples afresh from
  s+path — no look-ahead token is reused);
* else: ⊥ (a forced rejection; the block ends).

The probability of committing terminal N from s is therefore path-local:

    Q(N | s) = ∏_j q(N_j | s+N_<j) · [1 − Σ_{c ∈ children(N)} q(c | s+N)]   (the bracket only if N has children)

and Q(t | s) sums this over the (at most two) paths to t: its direct twin (d,) and its cache key.
Only the drafter rows along those paths are needed (:class:`RowOracle` computes any that were not
sampled).  Because no look-ahead is reused, the state after a committed proposal is just
s+N, and the next proposal's distribution is Q(·|s+N) again: every position is exact.  Stopping
decisions (the draft budget ``k``, the acceptance head) are taken only between walks, from the state
alone, so a bonus token from p stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from central.omnidraft.vocab import NgramCache, Proposal

Path = tuple[int, ...]


class RowOracle(Protocol):
    """q(·|s+prefix) over the draft vocabulary for a fixed block start s (memoised by the caller)."""

    def __call__(self, prefix: Path) -> Any: ...


def terminal(path: Path, bridge: Any, cache: NgramCache | None) -> int | None:
    """The target token ``path`` commits to (a cache key, or a single draft token's direct image)."""
    if cache is not None and len(path) > 1:
        return cache.entries.get(path)
    if len(path) == 1:
        t = int(bridge.d2t[path[0]])
        return t if t >= 0 else None
    return None


def _children(cache: NgramCache | None, path: Path) -> set[int]:
    return cache.children.get(path, set()) if cache is not None else set()


def _is_node(cache: NgramCache | None, path: Path) -> bool:
    return cache is not None and cache.is_node(path)


def walk(row: RowOracle, sample: Callable[[Any], int], s: Path, bridge: Any,
         cache: NgramCache | None) -> tuple[int | None, Path, int]:
    """One proposal from state ``s``: (target or None for ⊥, the draft tokens it consumes, tokens sampled)."""
    path: Path = ()
    sampled = 0
    while True:
        x = sample(row(s + path))
        sampled += 1
        ext = path + (x,)
        if _is_node(cache, ext):
            path = ext
            if not _children(cache, path):  # a leaf: always a key
                return terminal(path, bridge, cache), path, sampled
            continue
        if not path:
            return terminal(ext, bridge, cache), ext, sampled
        t = terminal(path, bridge, cache)
        if t is not None:
            return t, path, sampled  # x is discarded
        return None, ext, sampled


def paths_to(t: int, bridge: Any, cache: NgramCache | None) -> list[Path]:
    """Every draft path that commits to target ``t`` under :func:`walk`: its direct twin and its cache key."""
    out: list[Path] = []
    d = bridge.t2d.get(t)
    if d is not None:
        out.append((d,))
    if cache is not None:
        out += cache.keys_of.get(t, [])
    return out


def path_mass(path: Path, s: Path, row: RowOracle, cache: NgramCache | None, leave: bool = True) -> float:
    """Probability that :func:`walk` from ``s`` commits exactly ``path`` (``leave=False``: the old ∏q)."""
    m = 1.0
    for j in range(len(path)):
        m *= float(row(s + path[:j])[path[j]])
        if m == 0.0:
            return 0.0
    kids = _children(cache, path)
    if leave and kids:
        q = row(s + path)
        m *= max(0.0, 1.0 - float(sum(float(q[c]) for c in kids)))
    return m


def mass(t: int, s: Path, row: RowOracle, bridge: Any, cache: NgramCache | None, leave: bool = True) -> float:
    """Q(t | s): the exact probability that the next proposal from state ``s`` is target token ``t``."""
    return sum(path_mass(p, s, row, cache, leave) for p in paths_to(t, bridge, cache))


def full_mass(s: Path, row: RowOracle, bridge: Any, target_vocab: int) -> torch.Tensor:
    """Q(·|s) as a vector when there is no cache (variant a): the direct image of q(·|s)."""
    q = torch.as_tensor(row(s), dtype=torch.float64)
    out = torch.zeros(target_vocab, dtype=torch.float64)
    mapped = bridge.d2t >= 0
    out.index_add_(0, bridge.d2t[mapped], q[mapped])
    return out


@dataclass
class ExactDraft:
    """Proposals from consecutive walks; ``tokens`` = the consumed draft tokens (the ⊥ run included)."""

    tokens: list[int] = field(default_factory=list)
    props: list[Proposal] = field(default_factory=list)
    stuck: bool = False
    sampled: int = 0
    head_stop: bool = False


def draft_exact(row: RowOracle, sample: Callable[[Any], int], k: int, bridge: Any, cache: NgramCache | None,
                stop: Callable[[Path], bool] | None = None, max_props: int | None = None) -> ExactDraft:
    """Walk after walk while fewer than ``k`` draft tokens are consumed and ``stop(state)`` is false
    (and fewer than ``max_props`` proposals were made).

    A walk that starts before the budget runs out is finished (a block may consume up to
    k − 1 + ngram_max draft tokens): cutting it would make the stop depend on the draws of the
    position being proposed.
    """
    out = ExactDraft()
    while len(out.tokens) < k and (max_props is None or len(out.props) < max_props):
        s = tuple(out.tokens)
        t, path, n = walk(row, sample, s, bridge, cache)
        out.sampled += n
        if t is None:
            out.tokens += path
            out.stuck = True
            break
        out.props.append(Proposal(t, len(s), len(path)))
        out.tokens += path
        if stop is not None and len(out.tokens) < k and stop(tuple(out.tokens)):
            out.head_stop = True
            break
    return out


__all__ = ["walk", "draft_exact", "mass", "path_mass", "paths_to", "full_mass", "terminal", "ExactDraft", "RowOracle"]
