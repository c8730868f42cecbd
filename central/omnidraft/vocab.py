"""Cross-vocabulary translation: token bytes, the direct (intersection) map and the online n-gram cache.

Both vocabularies are byte-level BPE (the kit's tokenizers and SmolLM2's), so a token's "text" is
its byte string; two tokens map directly when their bytes are equal (special tokens when their
content is equal).  The n-gram cache maps a run of draft tokens to the one target token that spells
the same bytes; :func:`translate` turns a block of draft tokens into target proposals by greedy
longest match (cache first, then the direct map) and stops at the first untranslatable draft token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character → byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def byte_encoder() -> dict[int, str]:
    return {b: c for c, b in byte_decoder().items()}


def backend(tok: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a kit tokenizer or a Hugging Face fast tokenizer."""
    return getattr(tok, "backend_tokenizer", tok)


def token_bytes(tok: Any) -> list[bytes | None]:
    """The byte string of every token id (``None`` for special tokens and non-byte-level pieces)."""
    be = backend(tok)
    special = {i for i, t in be.get_added_tokens_decoder().items() if t.special}
    dec = byte_decoder()
    out: list[bytes | None] = []
    for i in range(be.get_vocab_size(with_added_tokens=True)):
        piece = be.id_to_token(i)
        if piece is None or i in special or not all(c in dec for c in piece):
            out.append(None)
        else:
            out.append(bytes(dec[c] for c in piece))
    return out


def special_tokens(tok: Any) -> dict[str, int]:
    be = backend(tok)
    return {t.content: i for i, t in be.get_added_tokens_decoder().items() if t.special}


@dataclass
class VocabBridge:
    """The two vocabularies side by side: the direct map and the draft spelling of target tokens."""

    draft_tok: Any
    target_tok: Any
    draft_bytes: list[bytes | None] = field(init=False)
    target_bytes: list[bytes | None] = field(init=False)
    d2t: torch.Tensor = field(init=False)  # draft id -> target id with the same bytes, or -1
    _spell: dict[int, tuple[int, ...]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.draft_bytes = token_bytes(self.draft_tok)
        self.target_bytes = token_bytes(self.target_tok)
        by_bytes = {b: i for i, b in enumerate(self.target_bytes) if b is not None}
        t_special = special_tokens(self.target_tok)
        d_special = {i: s for s, i in special_tokens(self.draft_tok).items()}
        d2t = [by_bytes.get(b, -1) if b is not None else t_special.get(d_special.get(i, ""), -1)
               for i, b in enumerate(self.draft_bytes)]
        self.d2t = torch.tensor(d2t, dtype=torch.long)
        self._t_special_to_d = {i: special_tokens(self.draft_tok).get(s) for s, i in t_special.items()}

    @property
    def draft_vocab(self) -> int:
        return len(self.draft_bytes)

    @property
    def target_vocab(self) -> int:
        return len(self.target_bytes)

    @property
    def t2d(self) -> dict[int, int]:
        """Target id -> the draft id with the same bytes (the inverse of the direct map)."""
        if not hasattr(self, "_t2d"):
            self._t2d = {int(t): d for d, t in enumerate(self.d2t.tolist()) if t >= 0}
        return self._t2d

    def intersection(self) -> int:
        """How many draft tokens have a target token of the same text."""
        return int((self.d2t >= 0).sum())

    def spelling(self, target_id: int) -> tuple[int, ...]:
        """The draft tokenizer's own (BPE) spelling of a target token's bytes; ``()`` if it has none."""
        if target_id not in self._spell:
            self._spell[target_id] = self._compute_spelling(target_id)
        return self._spell[target_id]

    def _compute_spelling(self, target_id: int) -> tuple[int, ...]:
        raw = self.target_bytes[target_id] if 0 <= target_id < self.target_vocab else None
        if raw is None:  # a special token: its draft twin, if any
            twin = self._t_special_to_d.get(target_id)
            return (twin,) if twin is not None else ()
        enc = byte_encoder()
        return tuple(t.id for t in backend(self.draft_tok).model.tokenize("".join(enc[b] for b in raw)))

    def encode_text(self, text: str) -> list[int]:
        """The draft tokenizer's encoding of ``text`` (for prompts)."""
        return backend(self.draft_tok).encode(text).ids

    def target_text(self, ids: list[int]) -> bytes:
        return b"".join(self.target_bytes[i] or b"" for i in ids)


class NgramCache:
    """Target token ↔ the run of draft tokens that spells it (runs of 2..``max_n`` draft tokens)."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.entries: dict[tuple[int, ...], int] = {}
        self.hits: dict[tuple[int, ...], int] = {}
        # the trie of the keys: every non-empty prefix of a key is a node; children[node] = next draft tokens
        self.children: dict[tuple[int, ...], set[int]] = {}
        self.keys_of: dict[int, list[tuple[int, ...]]] = {}  # target id -> its keys

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, target_id: int, spelling: tuple[int, ...]) -> bool:
        """Store one entry; True if it is new (single-token spellings are the direct map's job)."""
        if not 2 <= len(spelling) <= self.max_n or spelling in self.entries:
            return False
        self.entries[spelling] = target_id
        self.keys_of.setdefault(target_id, []).append(spelling)
        for j in range(len(spelling)):
            self.children.setdefault(spelling[:j], set()).add(spelling[j])
        return True

    def is_node(self, path: tuple[int, ...]) -> bool:
        """Whether ``path`` (non-empty) is a prefix of some key (a key itself included)."""
        return path in self.children or path in self.entries

    def match(self, drafts: list[int], start: int) -> tuple[int, int] | None:
        """The longest entry starting at ``drafts[start]``: (target id, its length), or None."""
        for n in range(min(self.max_n, len(drafts) - start), 1, -1):
            target = self.entries.get(tuple(drafts[start : start + n]))
            if target is not None:
                return target, n
        return None


@dataclass(frozen=True)
class Proposal:
    """One translated target proposal: the draft tokens ``drafts[start:start+n]`` spell ``target``."""

    target: int
    start: int
    n: int

    @property
    def merged(self) -> bool:
        return self.n > 1


def translate(drafts: list[int], bridge: VocabBridge, cache: NgramCache | None) -> tuple[list[Proposal], bool]:
    """Draft tokens → target proposals by greedy longest match (cache, then direct map).

    Returns the proposals and whether translation stopped at an untranslatable draft token (then the
    next target position is a forced rejection: the drafter's proposal there is "no target token").
    """
    out: list[Proposal] = []
    i = 0
    while i < len(drafts):
        hit = cache.match(drafts, i) if cache is not None else None
        if hit is not None:
            out.append(Proposal(hit[0], i, hit[1]))
            i += hit[1]
            continue
        direct = int(bridge.d2t[drafts[i]])
        if direct < 0:
            return out, True
        out.append(Proposal(direct, i, 1))
        i += 1
    return out, False


def proposal_q(q_rows: torch.Tensor, drafts: list[int], prop: Proposal) -> float:
    """The single-path q′ of a proposal: q(d) for a direct token, ∏ q(d_j) over the run for a merged one.

    Not the probability with which greedy longest-match translation proposes the target token (that
    also depends on the continuations that would have merged, and on every other path to the same
    token): speculative sampling no longer uses it (see :mod:`central.omnidraft.exact`); kept for the
    negative control of the exactness check and for the online parts' n-gram likelihood.
    """
    idx = torch.arange(prop.start, prop.start + prop.n)
    return float(q_rows[idx, torch.tensor(drafts[prop.start : prop.start + prop.n])].prod())


def residual_q(q_row: torch.Tensor, bridge: VocabBridge, merged: tuple[int, int, float] | None = None) -> torch.Tensor:
    """The drafter's one-step distribution pushed into the target vocabulary (unmapped mass dropped).

    (The old, inexact residual estimate for merged proposals; kept for the negative control.)

    ``merged`` = (merged target id, direct target id of the run's first draft token or -1, q′): the
    merged proposal's mass q′ = ∏q is moved from the first draft token's direct image to the merged
    token, so the residual (p − q̃)₊ is taken against (an estimate of) what could have been proposed.
    """
    out = torch.zeros(bridge.target_vocab, dtype=q_row.dtype)
    mapped = bridge.d2t >= 0
    out.index_add_(0, bridge.d2t[mapped], q_row[mapped])
    if merged is not None:
        target, first, qprime = merged
        if first >= 0:
            out[first] = (out[first] - qprime).clamp(min=0.0)
        out[target] += qprime
    return out


__all__ = ["VocabBridge", "NgramCache", "Proposal", "translate", "proposal_q", "residual_q", "token_bytes"]
