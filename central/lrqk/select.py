"""Which past tokens each query head attends to at a decode step, and the hit/miss K/V buffer.

Every sparse method attends, per *query* head, to a "top" set chosen by its own rule among the
*candidates* (all tokens before the recent window) plus the recent window (always resident in fast
memory, like the code's "lite" tokens).  The top set goes through a :class:`HitMissBuffer`: a fast
buffer of ``topk`` K/V rows per query head that keeps the rows already there and copies only the
missing ones from the (CPU-side, full-precision) store.

Selections are ``(H, n)`` long tensors of positions, sorted, padded with ``-1``.  Query head ``h``
reads key/value head ``h // groups`` (transformers' ``repeat_kv`` layout), as in the authors' code,
which repeats K to the query heads before factorising and selecting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from central.lrqk.factor import Factors, als_prefill, decode_update

PAD = -1


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(Hkv, T, d) → (Hkv·groups, T, d), query head ``h`` ↦ kv head ``h // groups``."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=0)


def grouped_scores(q: torch.Tensor, K: torch.Tensor, groups: int) -> torch.Tensor:
    """``q_h · K[h // groups]ᵀ`` for every query head without repeating K: q (H, 1, d), K (Hkv, n, d) → (H, n)."""
    Hkv, _, d = K.shape
    return (q.reshape(Hkv, groups, d) @ K.transpose(-1, -2)).reshape(Hkv * groups, -1)


def gather_rows(store: torch.Tensor, idx: torch.Tensor, groups: int) -> torch.Tensor:
    """Rows ``store[h // groups, idx[h]]`` as (H, n, d); padded entries give zero rows."""
    H, n = idx.shape
    kv = torch.arange(H, device=idx.device) // groups
    rows = store[kv[:, None], idx.clamp(min=0)]
    return rows * (idx >= 0)[..., None].to(rows.dtype)


def _topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores per row, in ascending position order."""
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def _all_candidates(H: int, n_cand: int) -> torch.Tensor:
    return torch.arange(n_cand).expand(H, n_cand).clone()


class HitMissBuffer:
    """``capacity`` K/V rows per query head in fast memory, refreshed by copying only the misses."""

    def __init__(self, n_heads: int, capacity: int, head_dim: int, dtype: torch.dtype = torch.float32) -> None:
        self.slots = torch.full((n_heads, capacity), PAD, dtype=torch.long)
        self.K = torch.zeros(n_heads, capacity, head_dim, dtype=dtype)
        self.V = torch.zeros(n_heads, capacity, head_dim, dtype=dtype)

    def update(self, sel: torch.Tensor, K_store: torch.Tensor, V_store: torch.Tensor,
               groups: int) -> torch.Tensor:
        """Make the buffer hold exactly ``sel`` (H, n ≤ capacity); returns the rows copied per head."""
        cap = self.slots.shape[1]
        if sel.shape[1] > cap:
            raise ValueError(f"selection of {sel.shape[1]} rows exceeds the buffer capacity {cap}")
        valid_new = sel >= 0
        match = (self.slots[:, :, None] == sel[:, None, :]) & valid_new[:, None, :] & (self.slots >= 0)[:, :, None]
        keep = match.any(-1)                      # slots whose row is still wanted (a hit)
        need = valid_new & ~match.any(-2)         # wanted rows not in the buffer (a miss)
        copies = need.sum(-1)
        if sel.shape[1] == 0:
            self.slots.fill_(PAD)
            return copies
        # the j-th missing row of head h goes to the j-th slot of h that is not kept
        free = ~keep
        free_rank = free.cumsum(-1) - 1
        fill = free & (free_rank < copies[:, None])
        order = torch.argsort((~need).to(torch.int8), dim=-1, stable=True)  # missing entries first, in order
        rows = sel.gather(-1, order.gather(-1, free_rank.clamp(0, sel.shape[1] - 1)))
        self.slots = torch.where(keep, self.slots, torch.where(fill, rows, PAD))
        h, s = fill.nonzero(as_tuple=True)
        src = (h // groups, rows[h, s])
        self.K[h, s] = K_store[src].to(self.K.dtype)   # the only rows that move: the misses
        self.V[h, s] = V_store[src].to(self.V.dtype)
        return copies

    def held(self) -> torch.Tensor:
        """The positions held per head, sorted (padded with -1 at the end)."""
        s = self.slots.clone()
        s[s < 0] = torch.iinfo(torch.long).max
        s = s.sort(-1).values
        s[s == torch.iinfo(torch.long).max] = PAD
        return s


class Selector(ABC):
    """A token-selection rule; one instance serves all layers (state keyed by layer index)."""

    name = "base"

    def __init__(self, topk: int, window: int) -> None:
        self.topk, self.window = topk, window

    def prefill(self, layer: int, Q: torch.Tensor, K: torch.Tensor, groups: int, total_len: int) -> torch.Tensor:
        """Set up after the exact prefill (Q: (H, P, d), K: (Hkv, P, d)); returns the initial top set."""
        return self.choose(layer, Q[:, -1:], K, groups, is_prefill=True)

    @abstractmethod
    def choose(self, layer: int, q: torch.Tensor, K: torch.Tensor, groups: int,
               is_prefill: bool = False) -> torch.Tensor:
        """The top set (H, ≤ topk) among the candidates ``[0, T − window)`` for the query ``q`` (H, 1, d)."""

    def n_candidates(self, T: int) -> int:
        return max(T - self.window, 0)


class WindowSelector(Selector):
    """Recent-window baseline: no top set, the window is the whole budget."""

    name = "window"

    def __init__(self, topk: int, window: int) -> None:
        super().__init__(0, topk + window)

    def choose(self, layer, q, K, groups, is_prefill=False):
        return torch.empty(q.shape[0], 0, dtype=torch.long)


class OracleSelector(Selector):
    """Reference: the exact top-k of ``q·Kᵀ`` (what a perfect proxy would pick)."""

    name = "oracle"

    def choose(self, layer, q, K, groups, is_prefill=False):
        n = self.n_candidates(K.shape[1])
        if n <= self.topk:
            return _all_candidates(q.shape[0], n)
        return _topk_sorted(grouped_scores(q, K[:, :n], groups), self.topk)


def page_bounds(q: torch.Tensor, K: torch.Tensor, groups: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's page scores: ``Σ_j max(q_j·min_j, q_j·max_j)`` ≥ ``q·k`` for every key ``k`` of the page.

    q: (H, 1, d), K: (Hkv, n, d) → (bounds (H, pages), page of each position (n,)).
    """
    Hkv, n, d = K.shape
    pages = -(-n // page_size)
    pad = pages * page_size - n
    lo = torch.cat([K, K.new_full((Hkv, pad, d), float("inf"))], 1).view(Hkv, pages, page_size, d).amin(2)
    hi = torch.cat([K, K.new_full((Hkv, pad, d), float("-inf"))], 1).view(Hkv, pages, page_size, d).amax(2)
    lo, hi = repeat_kv(lo, groups), repeat_kv(hi, groups)
    bounds = torch.maximum(q * lo, q * hi).sum(-1)
    return bounds, torch.arange(n) // page_size


class QuestSelector(Selector):
    """Quest-style pages: per-channel min/max per page, the top ``topk // page_size`` pages by upper bound."""

    name = "quest"

    def __init__(self, topk: int, window: int, page_size: int) -> None:
        super().__init__(topk, window)
        self.page_size = page_size

    def choose(self, layer, q, K, groups, is_prefill=False):
        n = self.n_candidates(K.shape[1])
        H = q.shape[0]
        if n <= self.topk:
            return _all_candidates(H, n)
        bounds, _ = page_bounds(q, K[:, :n], groups, self.page_size)
        n_pages = min(self.topk // self.page_size, bounds.shape[1])
        top = bounds.topk(n_pages, dim=-1).indices.sort(-1).values            # (H, n_pages)
        pos = top[..., None] * self.page_size + torch.arange(self.page_size)  # (H, n_pages, P)
        pos = pos.flatten(1)
        pos[pos >= n] = PAD                                                  # the last page may be partial
        out = torch.full((H, self.topk), PAD, dtype=torch.long)
        out[:, : pos.shape[1]] = pos
        return out


class LRQKSelector(Selector):
    """LRQK: rank-r proxy scores ``q̂·A_Kᵀ`` from the penalised-ALS factors, updated every step."""

    name = "lrqk"

    def __init__(self, topk: int, window: int, rank: int, *, lam_q: float = 1.0, lam_k: float = 1.0,
                 lam1: float = 1.0, lam2: float = 1.0, prefill_iters: int = 2, decode_iters: int = 2,
                 tol: float = 1e-8, init: str = "randn", generator: torch.Generator | None = None) -> None:
        super().__init__(topk, window)
        self.rank = rank
        self.lam_q, self.lam_k, self.lam1, self.lam2 = lam_q, lam_k, lam1, lam2
        self.prefill_iters, self.decode_iters, self.tol, self.init = prefill_iters, decode_iters, tol, init
        self.generator = generator
        self.B_Q: dict[int, torch.Tensor] = {}
        self.B_K: dict[int, torch.Tensor] = {}
        self.A_K: dict[int, torch.Tensor] = {}   # (H, capacity, r): row i = the rank-r key of token i
        self.length: dict[int, int] = {}
        self.prev_top: dict[int, torch.Tensor] = {}
        self.factors: dict[int, Factors] = {}

    def prefill(self, layer, Q, K, groups, total_len):
        H, P, _ = Q.shape
        f = als_prefill(Q.float(), repeat_kv(K, groups).float(), self.rank, self.lam_q, self.lam_k,
                        self.prefill_iters, self.tol, self.init, self.generator)
        self.factors[layer] = f
        self.B_Q[layer], self.B_K[layer] = f.B_Q, f.B_K
        self.A_K[layer] = torch.zeros(H, max(total_len, P), self.rank)
        self.A_K[layer][:, :P] = f.A_K
        self.length[layer] = P
        top = self._top(layer, f.A_Q[:, -1:], P)
        self.prev_top[layer] = top
        return top

    def _top(self, layer: int, q_hat: torch.Tensor, T: int) -> torch.Tensor:
        n = self.n_candidates(T)
        if n <= self.topk:
            return _all_candidates(q_hat.shape[0], n)
        scores = (q_hat @ self.A_K[layer][:, :n].transpose(-1, -2)).squeeze(1)  # O(l·r) proxy scores
        return _topk_sorted(scores, self.topk)

    def choose(self, layer, q, K, groups, is_prefill=False):
        T = K.shape[1]
        t = T - 1                                   # position of the new token
        if self.length[layer] != t:
            raise RuntimeError(f"layer {layer}: LRQK state has {self.length[layer]} tokens, the cache {t}")
        H = q.shape[0]
        prev_window = torch.arange(max(t - self.window, 0), t).expand(H, -1)
        omega = torch.cat([self.prev_top[layer], prev_window], 1)            # Ω_{t-1}
        A_sel = self.A_K[layer][torch.arange(H)[:, None], omega.clamp(min=0)] * (omega >= 0)[..., None]
        K_sel = gather_rows(K, omega, groups).float()
        k_new = repeat_kv(K[:, t:], groups).float()
        self.B_Q[layer], self.B_K[layer], q_hat, k_hat = decode_update(
            self.B_Q[layer], self.B_K[layer], A_sel, K_sel, q.float(), k_new, self.lam1, self.lam2,
            self.decode_iters, self.tol)
        A = self.A_K[layer]
        if t >= A.shape[1]:                          # grow (only when decoding past the planned length)
            A = self.A_K[layer] = torch.cat([A, torch.zeros_like(A)], 1)
        A[:, t] = k_hat.squeeze(1)
        self.length[layer] = T
        top = self._top(layer, q_hat, T)
        self.prev_top[layer] = top
        return top
