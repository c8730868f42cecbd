"""Cross-vocabulary speculative decoding with KV caches, and target-only decoding for comparison.

A :class:`CachedLM` keeps a model's ``DynamicCache`` in step with a token list: changing the list
crops the cache to the longest common prefix (a rejection costs no recomputation of the accepted
prefix) and the next forward feeds only the tokens the cache lacks.  :class:`SpecDecoder` runs one
variant: draft up to k draft tokens → translate (direct map, plus the n-gram cache) → one target
forward over [last token, proposals] → verify → extend both contexts → fill the cache → (online)
one distillation step and one head update.

Greedy decoding drafts k tokens and translates them by greedy longest match (:func:`translate`).
Speculative sampling instead drafts and translates together with the path-local walk of
:mod:`central.omnidraft.exact` (no look-ahead token reused, the head consulted only between
proposals), so that the acceptance ratio and the residual use the exact proposal probability.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from central.lm.lean import LeanLlama, supports
from central.omnidraft.exact import Path, draft_exact, full_mass, mass
from central.omnidraft.online import AcceptanceHead, OnlineDistiller, TrainItem
from central.omnidraft.verify import QRes, Verdict, sample_index, verify_greedy, verify_sample
from central.omnidraft.vocab import NgramCache, Proposal, VocabBridge, translate


class CachedLM:
    """A causal LM whose KV cache follows a token list (cropped on change, extended on forward).

    ``lean=True`` runs a supported Llama through :class:`central.lm.lean.LeanLlama` (the same function
    with far fewer Python ops per token; its own K/V buffer); any other model keeps transformers'
    forward with a ``DynamicCache``.
    """

    def __init__(self, model: torch.nn.Module, lean: bool = False) -> None:
        self.model = model
        self.lean = LeanLlama(model) if lean and supports(model) else None
        self.ids: list[int] = []
        self.cache: DynamicCache | None = None
        self.n_cached = 0
        self.calls = 0
        self.seconds = 0.0  # wall time inside the model's forward (profile of where decoding time goes)
        self.rebuild_seconds = 0.0  # the part of it spent re-encoding the context after invalidate()
        self._dropped = False

    def set_ids(self, ids: list[int]) -> None:
        keep = 0
        limit = min(self.n_cached, len(ids))
        while keep < limit and self.ids[keep] == ids[keep]:
            keep += 1
        self._crop(keep)
        self.ids = list(ids)

    def append(self, token: int) -> None:
        self.ids.append(token)

    def invalidate(self) -> None:
        """Drop the cache (the weights changed): the next forward re-encodes the whole context."""
        self.cache, self.n_cached, self._dropped = None, 0, True
        if self.lean is not None:
            self.lean.refresh()  # re-read the weights, LoRA folded in

    def _crop(self, keep: int) -> None:
        if self.lean is not None:
            self.n_cached = min(self.n_cached, keep)
            self.lean.crop(self.n_cached)
            return
        if self.cache is None or keep >= self.n_cached:
            return
        if keep == 0:
            self.cache, self.n_cached = None, 0
            return
        self.cache.crop(keep - self.cache.get_seq_length())
        self.n_cached = keep

    @torch.no_grad()
    def forward(self, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (and last-layer hidden states) for every token the cache lacks (at least one)."""
        if self.n_cached >= len(self.ids):
            self._crop(len(self.ids) - 1)
        rebuild, self._dropped = self._dropped, False
        start = time.perf_counter()
        if self.lean is not None:  # its cache length follows n_cached (_crop, invalidate, _count)
            logits, last = self.lean.forward(self.ids[self.n_cached :])
            self._count(time.perf_counter() - start, rebuild)
            return logits, (last if hidden else None)
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        new = torch.tensor([self.ids[self.n_cached :]])
        out = self.model(input_ids=new, cache=self.cache, use_cache=True, output_hidden_states=hidden)
        self._count(time.perf_counter() - start, rebuild)
        return out.logits[0], (out.hidden_states[-1][0] if hidden else None)

    def _count(self, spent: float, rebuild: bool) -> None:
        self.seconds += spent
        if rebuild:
            self.rebuild_seconds += spent
        self.n_cached = len(self.ids)
        self.calls += 1


@dataclass(frozen=True)
class Variant:
    """(a) direct map only; (b) + n-gram cache; (c) + online distillation; (d) + adaptive draft length."""

    name: str
    ngram: bool
    distill: bool
    head: bool


VARIANTS = {
    "a": Variant("a", ngram=False, distill=False, head=False),
    "b": Variant("b", ngram=True, distill=False, head=False),
    "c": Variant("c", ngram=True, distill=True, head=False),
    "d": Variant("d", ngram=True, distill=True, head=True),
}


@dataclass
class DecodeConfig:
    k: int = 6
    greedy: bool = True
    temperature: float = 1.0
    head_threshold: float = 0.3
    head_rule: str = "token"  # "token": stop when P(accept this token) < threshold; "cumulative": ∏P < threshold
    cache_prompt: bool = False
    drafter_window: int = 0  # when the drafter context would pass this, keep its last half (0: never)
    lean: bool = False  # both models through central.lm.lean where they are supported Llamas


@dataclass
class Stats:
    """Counters of one generation (one prompt)."""

    target_calls: int = 0
    drafter_calls: int = 0
    blocks: int = 0
    draft_tokens: int = 0
    proposals: int = 0
    accepted: int = 0
    accepted_draft_tokens: int = 0
    merged_proposals: int = 0
    merged_accepted: int = 0
    untranslatable: int = 0
    generated: int = 0
    chars: int = 0
    decode_seconds: float = 0.0
    train_seconds: float = 0.0
    head_stops: int = 0
    # where decode_seconds goes: the two models' forwards (the drafter's re-encodings of a dropped cache
    # counted apart); the rest is Python: translation, cache look-ups, verification, bookkeeping
    target_forward_seconds: float = 0.0
    drafter_forward_seconds: float = 0.0
    drafter_rebuild_seconds: float = 0.0

    @property
    def wasted(self) -> int:
        return self.draft_tokens - self.accepted_draft_tokens


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # the drafter's distribution for each token
    feats: list[torch.Tensor] = field(default_factory=list)  # head features (variant d)
    head_probs: list[float] = field(default_factory=list)  # the head's P(accept) per fed token (variant d)
    head_stop: bool = False
    rows: "DrafterRows | None" = None  # sampling: the drafter's distributions at every state it visited
    sampled: int = 0  # sampling: draft tokens sampled (discarded look-ahead tokens included)


class DrafterRows:
    """q(·|context + prefix) on demand, memoised; a KV-cached drafter forward for a state not yet seen."""

    def __init__(self, lm: "CachedLM", context: list[int], temperature: float, hidden: bool) -> None:
        self.lm, self.context, self.temperature, self.hidden = lm, list(context), temperature, hidden
        self.q: dict[Path, torch.Tensor] = {}
        self.h: dict[Path, torch.Tensor] = {}

    def __call__(self, prefix: Path) -> torch.Tensor:
        got = self.q.get(prefix)
        if got is None:
            self.lm.set_ids(self.context + list(prefix))
            logits, hidden = self.lm.forward(hidden=self.hidden)
            got = self.q[prefix] = probs(logits[-1], self.temperature)
            if hidden is not None:
                self.h[prefix] = hidden[-1]
        return got

    def hidden_at(self, prefix: Path) -> torch.Tensor:
        self(prefix)
        return self.h[prefix]


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, dim=-1)


class SpecDecoder:
    """One variant's decoder; its n-gram cache, LoRA and head persist across prompts (the stream)."""

    def __init__(self, variant: Variant, target: torch.nn.Module, drafter: torch.nn.Module, bridge: VocabBridge,
                 cfg: DecodeConfig, eos: set[int], *, ngram_max: int = 6, distiller: OnlineDistiller | None = None,
                 head: AcceptanceHead | None = None) -> None:
        self.variant, self.bridge, self.cfg, self.eos = variant, bridge, cfg, eos
        self.target, self.drafter = CachedLM(target, cfg.lean), CachedLM(drafter, cfg.lean)
        self.cache = NgramCache(ngram_max) if variant.ngram else None
        self.distiller, self.head = distiller, head
        self.head_log: list[tuple[float, float]] = []  # (prediction made while drafting, label learned after)

    # -- one prompt --------------------------------------------------------------------------------
    def generate(self, prompt: list[int], prompt_text: str, new_tokens: int, gen: torch.Generator) -> tuple[list[int], Stats]:
        stats = Stats()
        t_calls, d_calls = self.target.calls, self.drafter.calls
        t_fwd, d_fwd, d_rebuild = self.target.seconds, self.drafter.seconds, self.drafter.rebuild_seconds
        start = time.perf_counter()
        committed, context = list(prompt), self.bridge.encode_text(prompt_text)
        if self.cache is not None and self.cfg.cache_prompt:
            self._fill_cache(prompt)
        self.target.set_ids(committed)
        self.drafter.set_ids(context)
        out: list[int] = []
        while len(out) < new_tokens and not self.eos.intersection(out):
            new, context, items = self._block(committed, context, new_tokens - len(out), gen, stats)
            committed += new
            out += new
            if self.distiller is not None:
                t0 = time.perf_counter()
                self.distiller.update(context, items)  # calls the drafter module directly, not its CachedLM
                self.drafter.invalidate()
                stats.train_seconds += time.perf_counter() - t0
        out = _cut_at_eos(out, self.eos)
        stats.generated, stats.chars = len(out), len(self.bridge.target_text(out))
        stats.target_calls, stats.drafter_calls = self.target.calls - t_calls, self.drafter.calls - d_calls
        stats.decode_seconds = time.perf_counter() - start - stats.train_seconds
        stats.target_forward_seconds = self.target.seconds - t_fwd
        stats.drafter_forward_seconds = self.drafter.seconds - d_fwd
        stats.drafter_rebuild_seconds = self.drafter.rebuild_seconds - d_rebuild
        return out, stats

    def _block(self, committed: list[int], context: list[int], remaining: int, gen: torch.Generator,
               stats: Stats) -> tuple[list[int], list[int], list[TrainItem]]:
        window = self.cfg.drafter_window
        if window and len(context) + self.cfg.k > window:  # stay inside the positions the drafter was trained on
            context = context[-(window // 2):]
            self.drafter.set_ids(context)
        base = len(context)
        if self.cfg.greedy:
            draft = self.draft(gen)
            props, stuck = translate(draft.tokens, self.bridge, self.cache)
        else:
            draft, props, stuck = self.draft_sampling(context, gen, max_props=remaining - 1)
        # Never propose past the requested length: position `remaining` gets no proposal, whatever the
        # draft had there — a real token *or* an untranslatable one (⊥).  (Keeping ⊥ there, as the
        # code once did, drew that position from the residual only when the draft happened to be stuck:
        # a bias the powered exactness check found.)
        if len(props) + int(stuck) > remaining - 1:
            props, stuck = props[: remaining - 1], False
        m = len(props)
        logits = self._target_logits(committed + [p.target for p in props], m)
        p = probs(logits, self.cfg.temperature)
        verdict = self.verify(p, logits, props, draft, stuck, gen)
        n = verdict.accepted
        used = props[n - 1].start + props[n - 1].n if n else 0
        new = [pr.target for pr in props[:n]] + [verdict.token]
        spelled = list(self.bridge.spelling(verdict.token))
        items = [TrainItem(base + pr.start, tuple(draft.tokens[pr.start : pr.start + pr.n]), p[i], pr.target)
                 for i, pr in enumerate(props[:n])]
        items.append(TrainItem(base + used, tuple(spelled), p[n], verdict.token))
        context = context[:base] + draft.tokens[:used] + spelled
        self.drafter.set_ids(context)
        if self.cache is not None:
            self._fill_cache(new)
            for pr in props[:n]:
                if pr.merged:
                    key = tuple(draft.tokens[pr.start : pr.start + pr.n])
                    self.cache.hits[key] = self.cache.hits.get(key, 0) + 1
        if self.head is not None:
            t0 = time.perf_counter()
            self._train_head(draft, props, stuck, verdict)
            stats.train_seconds += time.perf_counter() - t0
        self._count(stats, draft, props, stuck, n, used)
        return new, context, items

    # -- drafting and verification -------------------------------------------------------------------
    def _target_logits(self, ids: list[int], m: int) -> torch.Tensor:
        """The target's logits at the last m + 1 positions of ``ids`` (one KV-cached forward)."""
        self.target.set_ids(ids)
        self.target._crop(len(ids) - m - 1)  # the forward must cover the last committed token (a warm cache may hold it)
        return self.target.forward()[0][-(m + 1):]

    def _rows(self, context: list[int]) -> DrafterRows:
        return DrafterRows(self.drafter, context, self.cfg.temperature, hidden=self.head is not None)

    def draft_sampling(self, context: list[int], gen: torch.Generator,
                       max_props: int | None = None) -> tuple[Draft, list[Proposal], bool]:
        """Draft and translate with the exact walk (:func:`draft_exact`); the head stops only between walks."""
        rows = self._rows(context)
        out = Draft(rows=rows)
        head, cumulative = self.head, [1.0]

        def sample(q: torch.Tensor) -> int:
            return sample_index(q, gen)

        def feed(tokens: Path) -> None:  # head features and predictions for the newly consumed tokens
            assert head is not None
            for j in range(len(out.feats), len(tokens)):
                feats = head.features(rows.hidden_at(tokens[: j + 1]), rows(tokens[:j]), tokens[j])
                out.feats.append(feats)
                out.head_probs.append(head.prob(feats))
                cumulative[0] *= out.head_probs[-1]

        def stop(tokens: Path) -> bool:
            feed(tokens)
            score = cumulative[0] if self.cfg.head_rule == "cumulative" else out.head_probs[-1]
            return score < self.cfg.head_threshold

        ex = draft_exact(rows, sample, self.cfg.k, self.bridge, self.cache, stop if head is not None else None,
                         max_props=max_props)
        out.tokens, out.sampled, out.head_stop = ex.tokens, ex.sampled, ex.head_stop
        if head is not None:  # features up to the first untranslatable token (its label is 0)
            end = sum(pr.n for pr in ex.props)
            feed(tuple(ex.tokens[: min(len(ex.tokens), end + 1)]))
        return out, ex.props, ex.stuck

    def _qres(self, rows: DrafterRows, s: Path) -> QRes:
        """Q(·|s) for the residual: a vector without an n-gram cache, else t ↦ Q(t) (exact, path-local)."""
        if not self.cache and isinstance(rows(s), torch.Tensor):  # (table rows of the toy check: points)
            return full_mass(s, rows, self.bridge, self.bridge.target_vocab)
        return lambda t: mass(t, s, rows, self.bridge, self.cache)

    def draft(self, gen: torch.Generator) -> Draft:
        """Up to k draft tokens (fewer when the acceptance head says stop); tokens fed as they come."""
        out = Draft()
        logits, _ = self.drafter.forward()
        row, cumulative = logits[-1], 1.0
        for j in range(self.cfg.k):
            q = probs(row, self.cfg.temperature)
            token = int(q.argmax()) if self.cfg.greedy else int(torch.multinomial(q, 1, generator=gen))
            out.tokens.append(token)
            out.q.append(q)
            if self.head is None and j == self.cfg.k - 1:
                break
            self.drafter.append(token)
            logits, hidden = self.drafter.forward(hidden=self.head is not None)
            row = logits[-1]
            if self.head is not None and hidden is not None:
                feats = self.head.features(hidden[-1], q, token)
                out.feats.append(feats)
                accept = self.head.prob(feats)
                out.head_probs.append(accept)
                cumulative *= accept
                score = cumulative if self.cfg.head_rule == "cumulative" else accept
                if score < self.cfg.head_threshold and j < self.cfg.k - 1:
                    out.head_stop = True
                    break
        return out

    def verify(self, p: torch.Tensor, logits: torch.Tensor, props: list[Proposal], draft: Draft, stuck: bool,
                gen: torch.Generator, greedy: bool | None = None) -> Verdict:
        targets = [pr.target for pr in props]
        if self.cfg.greedy if greedy is None else greedy:
            return verify_greedy(logits, targets)
        rows = draft.rows
        if rows is None:
            raise ValueError("speculative sampling needs a draft from draft_sampling (the exact walk)")
        states = [tuple(draft.tokens[: pr.start]) for pr in props]
        qprime = [mass(pr.target, s, rows, self.bridge, self.cache) for pr, s in zip(props, states)]
        qres = [self._qres(rows, s) for s in states]
        if stuck:  # the walk after the last proposal ended in ⊥: a proposal of "nothing"
            qres.append(self._qres(rows, tuple(draft.tokens[: sum(pr.n for pr in props)])))
        return verify_sample(p, targets, qprime, qres, "reject" if stuck else "bonus", gen)

    # -- online parts and bookkeeping ------------------------------------------------------------------
    def _fill_cache(self, tokens: list[int]) -> None:
        assert self.cache is not None
        for t in tokens:
            self.cache.add(t, self.bridge.spelling(t))

    def _train_head(self, draft: Draft, props: list[Proposal], stuck: bool, verdict: Verdict) -> None:
        """Label each draft token with its proposal's acceptance (min(1, p/q′), or exact match if greedy)."""
        assert self.head is not None
        feats, labels = [], []
        for pr, a in zip(props, verdict.accept_probs):
            for j in range(pr.start, pr.start + pr.n):
                if j < len(draft.feats):
                    feats.append(draft.feats[j])
                    labels.append(a)
                    self.head_log.append((draft.head_probs[j], a))
        bad = sum(pr.n for pr in props)
        if stuck and bad < len(draft.feats):
            feats.append(draft.feats[bad])
            labels.append(0.0)
            self.head_log.append((draft.head_probs[bad], 0.0))
        self.head.update(feats, labels)

    def _count(self, stats: Stats, draft: Draft, props: list[Proposal], stuck: bool, n: int, used: int) -> None:
        stats.blocks += 1
        stats.draft_tokens += draft.sampled or len(draft.tokens)
        stats.proposals += len(props)
        stats.accepted += n
        stats.accepted_draft_tokens += used
        stats.merged_proposals += sum(pr.merged for pr in props)
        stats.merged_accepted += sum(pr.merged for pr in props[:n])
        stats.untranslatable += int(stuck)
        stats.head_stops += int(draft.head_stop)


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def target_only(target: CachedLM, prompt: list[int], new_tokens: int, *, greedy: bool, temperature: float,
                eos: set[int], gen: torch.Generator) -> tuple[list[int], float, int]:
    """Plain KV-cached decoding with the target: (tokens, seconds, target calls)."""
    start, calls = time.perf_counter(), target.calls
    target.set_ids(prompt)
    out: list[int] = []
    while len(out) < new_tokens and not (out and out[-1] in eos):
        logits = target.forward()[0][-1]
        token = int(logits.argmax()) if greedy else int(torch.multinomial(probs(logits, temperature), 1, generator=gen))
        out.append(token)
        target.append(token)
    return out, time.perf_counter() - start, target.calls - calls


__all__ = ["CachedLM", "DrafterRows", "SpecDecoder", "Variant", "VARIANTS", "DecodeConfig", "Stats", "target_only"]
