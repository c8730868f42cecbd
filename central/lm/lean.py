"""A lean KV-cached inference forward for transformers' ``LlamaForCausalLM`` (tiny LMs, SmolLM2).

Why: at the kit's scale a decoding step is dominated by per-forward Python overhead, not arithmetic.
transformers' forward of the 0.27M-parameter drafter costs about as much as that of the 4.2M target
(issue #26: OmniDraft's drafter, 500x smaller than SmolLM2, still made speculative decoding slower
than plain decoding). :class:`LeanLlama` computes the same function with a handful of tensor ops per
layer: fused q/k/v and gate/up weights, a preallocated K/V buffer that a crop only shortens, RoPE
tables computed once by the model's own rotary module.

The maths is transformers' eager Llama step for step (RMSNorm in float32 then back, RoPE by
rotate-half, softmax in float32, SiLU MLP, the final norm's output as the last hidden state, a tied
or untied head), so outputs agree with ``model(...)`` to float rounding (tested in float64 to 1e-10,
with grouped-query attention, incremental tokens, crops and LoRA).  LoRA wrappers
(:class:`central.omnidraft.online.LoRALinear`, anything with ``base``, ``lora_a``, ``lora_b``,
``scale``) are folded into the weights by :meth:`LeanLlama.refresh`; call it whenever the weights
change (``CachedLM.invalidate`` does).  Inference only: no gradients, no dropout, batch size 1.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def effective_weight(layer: nn.Module) -> torch.Tensor:
    """The weight a bias-free linear layer applies, a LoRA update folded in."""
    if isinstance(layer, nn.Linear):
        if layer.bias is not None:
            raise ValueError("LeanLlama supports bias-free projections only (Llama's attention_bias/mlp_bias off)")
        return layer.weight.detach()
    if all(hasattr(layer, a) for a in ("base", "lora_a", "lora_b", "scale")):
        base = effective_weight(layer.base)
        return base + layer.scale * (layer.lora_b.detach() @ layer.lora_a.detach())
    raise ValueError(f"LeanLlama cannot read a projection of type {type(layer).__name__}")


def supports(model: nn.Module) -> bool:
    """Whether ``model`` is a Llama this forward reproduces (SiLU MLP, plain RoPE, no biases)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "llama" or not hasattr(model, "model"):
        return False
    rope = getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    return (cfg.hidden_act == "silu" and rope_type == "default" and not getattr(cfg, "attention_bias", False)
            and not getattr(cfg, "mlp_bias", False))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LeanLlama:
    """``model``'s logits and last hidden states for new tokens, with its own K/V cache (length ``length``)."""

    def __init__(self, model: nn.Module) -> None:
        if not supports(model):
            raise ValueError("LeanLlama needs a transformers LlamaForCausalLM (SiLU, default RoPE, no biases)")
        self.model = model
        cfg = model.config
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.scaling = self.head_dim ** -0.5
        weight = model.model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.k = self.v = torch.zeros(0, 0, 0, 0)  # (layers, kv heads, capacity, head dim), grown by _reserve
        self.length = 0
        self._cos = self._sin = torch.zeros(0)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the weights (after training steps or a LoRA change); the cache is dropped."""
        m = self.model.model
        self.embed = m.embed_tokens.weight.detach()
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([effective_weight(a.q_proj), effective_weight(a.k_proj), effective_weight(a.v_proj)])
            gate_up = torch.cat([effective_weight(mlp.gate_proj), effective_weight(mlp.up_proj)])
            self.layers.append((layer.input_layernorm.weight.detach(), qkv, effective_weight(a.o_proj),
                                layer.post_attention_layernorm.weight.detach(), gate_up,
                                effective_weight(mlp.down_proj)))
        self.norm = m.norm.weight.detach()
        self.head = effective_weight(self.model.lm_head)
        self.length = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        self.length = min(self.length, max(0, length))

    def _reserve(self, total: int) -> None:
        """Room for ``total`` positions in the K/V buffers and the RoPE tables (doubling as needed)."""
        capacity = self.k.shape[2]
        if total <= capacity:
            return
        size = max(64, total, 2 * capacity)
        shape = (len(self.layers), self.n_kv, size, self.head_dim)
        k, v = torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.length:
            k[:, :, : self.length], v[:, :, : self.length] = self.k[:, :, : self.length], self.v[:, :, : self.length]
        self.k, self.v = k, v
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, torch.arange(size, device=self.device)[None])
        self._cos, self._sin = cos[0], sin[0]

    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, last hidden states) at the positions of ``ids``, appended after the cached ones."""
        start, n = self.length, len(ids)
        end = start + n
        self._reserve(end)
        x = self.embed[torch.tensor(ids, device=self.device)]
        cos, sin = self._cos[start:end], self._sin[start:end]
        mask = None
        if n > 1:
            mask = torch.full((n, end), float("-inf"), dtype=self.dtype, device=self.device).triu(start + 1)
        groups = self.n_heads // self.n_kv
        hq, hk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        for i, (w_in, w_qkv, w_o, w_post, w_gu, w_down) in enumerate(self.layers):
            qkv = F.linear(_rms(x, w_in, self.eps), w_qkv)
            q = qkv[:, :hq].view(n, self.n_heads, self.head_dim).transpose(0, 1)
            k = qkv[:, hq : hq + hk].view(n, self.n_kv, self.head_dim).transpose(0, 1)
            v = qkv[:, hq + hk :].view(n, self.n_kv, self.head_dim).transpose(0, 1)
            self.k[i, :, start:end] = _rope(k, cos, sin)
            self.v[i, :, start:end] = v
            keys, values = self.k[i, :, :end], self.v[i, :, :end]
            if groups > 1:
                keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
            scores = torch.matmul(_rope(q, cos, sin), keys.transpose(1, 2)) * self.scaling
            if mask is not None:
                scores = scores + mask
            attn = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype), values)
            x = x + F.linear(attn.transpose(0, 1).reshape(n, hq), w_o)
            gate, up = F.linear(_rms(x, w_post, self.eps), w_gu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w_down)
        self.length = end
        hidden = _rms(x, self.norm, self.eps)
        return F.linear(hidden, self.head), hidden


__all__ = ["LeanLlama", "effective_weight", "supports"]
