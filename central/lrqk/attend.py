"""Sparse decoding inside a real transformers Llama: a registered attention function and a replay loop.

Route: a custom attention function registered with transformers' ``AttentionInterface`` under
:data:`ATTN_NAME` (its mask function is eager's).  ``LlamaAttention.forward`` computes q/k/v, applies
the rotary embedding and appends k/v to the ``DynamicCache`` (our full-precision "CPU-side" store),
then calls this function with the module (hence ``layer_idx``), the query (1, H, q_len, d) and the
whole cached K/V (1, Hkv, T, d).  Prefill (q_len > 1) is transformers' own eager attention, exact as
in the paper; each decode step (q_len = 1) asks the layer's :class:`SparseRunner` for the output:
exact softmax attention over the selected rows only (the hit/miss buffer + the recent window).
With no runner attached the function *is* eager attention.

The runner also measures, per layer and query head, against full attention with the same query:
attention-mass recall (full softmax mass on the attended tokens), relative L2 output error, and the
rows copied into the buffer with and without the hit/miss cache.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.models.llama.modeling_llama import eager_attention_forward

from central.lrqk.select import HitMissBuffer, Selector, grouped_scores, repeat_kv

ATTN_NAME = "lrqk_sparse"


def sparse_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eager attention for prefill (recorded by the runner); the runner's sparse attention for decode."""
    runner: SparseRunner | None = getattr(module, "_lrqk_runner", None)
    if runner is None or query.shape[2] > 1:
        out = eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if runner is not None:
            runner.record_prefill(module.layer_idx, query, key, value)
        return out
    if query.shape[0] != 1:
        raise ValueError("sparse decoding is implemented for batch size 1")
    out = runner.decode(module.layer_idx, query[0], key[0], value[0], scaling)
    return out.transpose(0, 1).unsqueeze(0), None


def register() -> None:
    """Register :data:`ATTN_NAME` with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, sparse_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextlib.contextmanager
def attached(model: Any, runner: "SparseRunner") -> Iterator[None]:
    """Route every decoder layer's attention through ``runner`` (and restore the model after)."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    layers = model.model.layers
    for layer in layers:
        layer.self_attn._lrqk_runner = runner
    try:
        yield
    finally:
        for layer in layers:
            del layer.self_attn._lrqk_runner
        model.set_attn_implementation(previous)


@dataclass
class Shape:
    """What the runner needs to know about the model."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def groups(self) -> int:
        return self.n_heads // self.n_kv_heads

    @classmethod
    def of(cls, model: Any) -> "Shape":
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, head_dim)


@dataclass
class StepStats:
    """Per decode step, one row per layer and one column per query head."""

    recall: torch.Tensor
    out_err: torch.Tensor
    copies: torch.Tensor
    copies_no_cache: torch.Tensor


class SparseRunner:
    """Per-layer selection state + hit/miss buffers; ``selector=None`` is full attention."""

    def __init__(self, shape: Shape, selector: Selector | None, total_len: int) -> None:
        self.shape, self.selector, self.total_len = shape, selector, total_len
        self.buffers: dict[int, HitMissBuffer] = {}
        self.prefill_q: dict[int, torch.Tensor] = {}
        self.steps: list[StepStats] = []
        self._rows: dict[str, list[torch.Tensor]] = {}

    # -- prefill ---------------------------------------------------------------------------------
    def record_prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.prefill_q[layer] = query[0].detach()
        if self.selector is not None:
            self._start_layer(layer, query[0], key[0], value[0])

    def start(self, prefill_q: dict[int, torch.Tensor], cache: Any) -> None:
        """Initialise every layer from a prefill run elsewhere (its queries and its K/V cache)."""
        self.prefill_q = prefill_q
        if self.selector is not None:
            for layer in range(self.shape.n_layers):
                self._start_layer(layer, prefill_q[layer], cache.layers[layer].keys[0], cache.layers[layer].values[0])

    def _start_layer(self, layer: int, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> None:
        assert self.selector is not None
        top = self.selector.prefill(layer, Q, K, self.shape.groups, self.total_len)
        capacity = max(min(self.selector.topk, self.total_len), 1)
        buf = HitMissBuffer(self.shape.n_heads, capacity, self.shape.head_dim, K.dtype)
        buf.update(top, K, V, self.shape.groups)  # the initial fill is part of prefill, not counted
        self.buffers[layer] = buf

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, layer: int, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention output (H, 1, d) for one new query; records the step's metrics for this layer."""
        g = self.shape.groups
        H, T = q.shape[0], K.shape[1]
        p_full = torch.softmax(grouped_scores(q, K, g).float() * scaling, dim=-1)        # (H, T)
        o_full = (p_full.to(V.dtype).view(-1, g, T) @ V).view(H, 1, -1)                # no repeated K/V
        if self.selector is None:
            self._record(layer, torch.ones(H), torch.zeros(H), torch.zeros(H), torch.zeros(H))
            return o_full
        top = self.selector.choose(layer, q, K, g)
        buf = self.buffers[layer]
        copies = buf.update(top, K, V, g)
        window = torch.arange(max(T - self.selector.window, 0), T)
        keys = torch.cat([buf.K, repeat_kv(K[:, window], g)], 1)
        vals = torch.cat([buf.V, repeat_kv(V[:, window], g)], 1)
        pos = torch.cat([buf.slots, window.expand(H, -1)], 1)
        logits = (q @ keys.transpose(-1, -2)).float() * scaling
        logits = logits.masked_fill((pos < 0)[:, None, :], float("-inf"))
        p = torch.softmax(logits, dim=-1)
        out = p.to(vals.dtype) @ vals
        recall = (p_full.gather(-1, pos.clamp(min=0)) * (pos >= 0)).sum(-1)
        err = (out - o_full).norm(dim=(-1, -2)) / o_full.norm(dim=(-1, -2)).clamp_min(1e-12)
        self._record(layer, recall, err, copies.float(), (top >= 0).sum(-1).float())
        return out

    def _record(self, layer: int, recall: torch.Tensor, err: torch.Tensor, copies: torch.Tensor,
                no_cache: torch.Tensor) -> None:
        for name, value in (("recall", recall), ("out_err", err), ("copies", copies), ("copies_no_cache", no_cache)):
            self._rows.setdefault(name, []).append(value.detach().float())
        if layer == self.shape.n_layers - 1:
            self.steps.append(StepStats(*(torch.stack(self._rows[n]) for n in
                                          ("recall", "out_err", "copies", "copies_no_cache"))))
            self._rows = {}


@dataclass
class Prefill:
    """The shared exact prefill: its cache, its queries per layer and its last logits."""

    cache: Any
    queries: dict[int, torch.Tensor]
    seconds: float


@torch.no_grad()
def run_prefill(model: Any, ids: torch.Tensor, prefill_len: int) -> Prefill:
    """Exact prefill of ``ids[:prefill_len]`` (every method starts from this same state)."""
    from transformers import DynamicCache

    start = time.perf_counter()
    recorder = SparseRunner(Shape.of(model), None, prefill_len)
    cache = DynamicCache(config=model.config)
    with attached(model, recorder):
        model(input_ids=ids[None, :prefill_len], cache=cache, use_cache=True)
    return Prefill(cache, recorder.prefill_q, time.perf_counter() - start)


@dataclass
class Replay:
    """One method's teacher-forced decode: per-token losses and per-step stats."""

    losses: torch.Tensor
    steps: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0
    logits: torch.Tensor | None = None


@torch.no_grad()
def replay(model: Any, ids: torch.Tensor, prefill: Prefill, steps: int, selector: Selector | None,
           keep_logits: bool = False) -> Replay:
    """Decode ``ids[P : P+steps]`` one token at a time (teacher forcing) with ``selector`` in every layer.

    The loss at step ``s`` is the cross-entropy of ``ids[P+s+1]`` given the logits after feeding ``ids[P+s]``.
    """
    P = prefill.cache.get_seq_length()
    if len(ids) < P + steps + 1:
        raise ValueError(f"need {P + steps + 1} tokens, have {len(ids)}")
    cache = copy.deepcopy(prefill.cache)
    runner = SparseRunner(Shape.of(model), selector, P + steps)
    runner.start(prefill.queries, cache)
    losses, kept = [], []
    start = time.perf_counter()
    with attached(model, runner):
        for s in range(steps):
            logits = model(input_ids=ids[None, P + s : P + s + 1], cache=cache, use_cache=True).logits[0, -1]
            losses.append(torch.nn.functional.cross_entropy(logits.float(), ids[P + s + 1]))
            if keep_logits:
                kept.append(logits)
    return Replay(torch.stack(losses), runner.steps, time.perf_counter() - start,
                  torch.stack(kept) if keep_logits else None)
