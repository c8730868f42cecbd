"""DEFT, LoRA and PaRa as wrappers of a frozen ``nn.Linear`` or ``nn.Conv2d``.

Every wrapper views the frozen weight as a matrix W (out × in; a conv kernel as out × in·k·k),
computes the adapted matrix W′ from its trainable pieces, and applies it with the base layer's own
bias, stride, padding and dilation:

* :class:`DeftLayer`  W′ = W − QQᵀW + g·QR, Q = orthonormal basis of P (reduced QR), g = σ(gate) or 1
  (the authors' ``residual_projection``, ``deft/injection.py``).  ``q_mode="cached"`` computes Q once
  from P under ``no_grad`` (the authors' default ``compute_svd_each_forward=False``: P never trains);
  ``q_mode="trained"`` recomputes Q differentiably every call.
* :class:`LoraLayer`  W′ = W + (α/r)·BA with B = 0, A Kaiming-uniform (standard LoRA / peft init).
* :class:`ParaLayer`  W′ = (I − QQᵀ)W with Q = QR(P), P trainable (PaRa: rank reduction only).

:func:`wrap_model` swaps named sub-modules for wrappers and freezes everything else.
"""

from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ADAPTERS = ("deft", "lora", "para")
Q_MODES = ("cached", "trained")
DEFT_INITS = ("authors", "preserve")


@dataclass(frozen=True)
class AdapterSpec:
    """Which adapter to attach and its hyper-parameters (the authors' defaults)."""

    kind: str = "deft"  # deft | lora | para
    rank: int = 4
    q_mode: str = "cached"  # deft: cached (authors' default, P frozen in effect) | trained
    gate: bool = False  # deft: scale the injected QR by sigmoid(gate), gate initialised at 0.5
    init_scale: float = 1.0  # deft: R ~ N(0, (0.02·init_scale)²) (KnowledgeInjectionConfig default 1.0)
    deft_init: str = "authors"  # deft: authors (P, R ~ N(0, 0.02)) | preserve (R₀ = QᵀW/g: W′ = W at step 0)
    lora_alpha: float = 8.0  # lora: scaling α/r (the authors' and peft's default α = 8)


def as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """A Linear weight as is, a conv kernel (out, in, k, k) reshaped to (out, in·k·k)."""
    return weight.reshape(weight.shape[0], -1)


def orthonormal_basis(p: torch.Tensor) -> torch.Tensor:
    """Q of the reduced QR decomposition of P (out × r, r ≤ out): orthonormal columns spanning P."""
    q, _ = torch.linalg.qr(p.float(), mode="reduced")
    return q.to(p.dtype)


def deft_weight(w: torch.Tensor, q: torch.Tensor, r: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """W′ = W − QQᵀW + scale·QR (the formula, on matrices)."""
    return w - q @ (q.T @ w) + scale * (q @ r)


def para_weight(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """W′ = (I − QQᵀ)W."""
    return w - q @ (q.T @ w)


def lora_weight(w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float) -> torch.Tensor:
    """W′ = W + scaling·BA."""
    return w + scaling * (b @ a)


class _Adapted(nn.Module, metaclass=ABCMeta):
    """A frozen Linear/Conv2d whose weight matrix is replaced by :meth:`adapted` at every call."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        if not isinstance(base, (nn.Linear, nn.Conv2d)):
            raise TypeError(f"only nn.Linear and nn.Conv2d can be adapted, got {type(base).__name__}")
        if isinstance(base, nn.Conv2d) and (base.groups != 1 or base.padding_mode != "zeros"):
            raise TypeError("only ungrouped, zero-padded Conv2d layers can be adapted")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.out_dim, self.in_dim = as_matrix(base.weight).shape

    @abstractmethod
    def adapted(self, w: torch.Tensor) -> torch.Tensor:
        """W′ from the frozen weight matrix W (out × in)."""

    def weight(self) -> torch.Tensor:
        """The adapted weight in the base layer's shape."""
        return self.adapted(as_matrix(self.base.weight)).reshape(self.base.weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight()
        if isinstance(self.base, nn.Linear):
            return F.linear(x, w, self.base.bias)
        b = self.base
        return F.conv2d(x, w, b.bias, b.stride, b.padding, b.dilation, b.groups)

    def effective_parameters(self) -> int:
        """Trainable parameters that actually receive gradients."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


class DeftLayer(_Adapted):
    """W′ = W − QQᵀW + σ(gate)·QR with Q = QR(P) (cached once, or recomputed with gradient)."""

    def __init__(self, base: nn.Module, spec: AdapterSpec, generator: torch.Generator | None = None) -> None:
        super().__init__(base)
        if not 1 <= spec.rank <= self.out_dim:
            raise ValueError(f"rank {spec.rank} must be in [1, {self.out_dim}] (the layer's output dim)")
        self.q_mode = spec.q_mode
        self.P = nn.Parameter(torch.randn(self.out_dim, spec.rank, generator=generator) * 0.02)
        self.R = nn.Parameter(torch.randn(spec.rank, self.in_dim, generator=generator) * (0.02 * spec.init_scale))
        self.gate = nn.Parameter(torch.full((1,), 0.5)) if spec.gate else None
        self.register_buffer("q_cached", None, persistent=False)
        if spec.deft_init == "preserve":
            with torch.no_grad():
                self.R.copy_(self.basis().T @ as_matrix(base.weight) / self.scale())

    def basis(self) -> torch.Tensor:
        """Q: cached without gradient (P gets none) or recomputed differentiably from P."""
        if self.q_mode == "trained":
            return orthonormal_basis(self.P)
        if self.q_cached is None:
            with torch.no_grad():
                self.q_cached = orthonormal_basis(self.P).detach()
        return self.q_cached

    def scale(self) -> torch.Tensor | float:
        return torch.sigmoid(self.gate) if self.gate is not None else 1.0

    def adapted(self, w: torch.Tensor) -> torch.Tensor:
        return deft_weight(w, self.basis(), self.R, self.scale())

    def effective_parameters(self) -> int:
        frozen_p = self.P.numel() if self.q_mode == "cached" else 0
        return super().effective_parameters() - frozen_p


class LoraLayer(_Adapted):
    """W′ = W + (α/r)·BA, B (out × r) zero, A (r × in) Kaiming-uniform(a=√5)."""

    def __init__(self, base: nn.Module, spec: AdapterSpec, generator: torch.Generator | None = None) -> None:
        super().__init__(base)
        if not 1 <= spec.rank <= min(self.out_dim, self.in_dim):
            raise ValueError(f"rank {spec.rank} must be in [1, {min(self.out_dim, self.in_dim)}]")
        self.scaling = spec.lora_alpha / spec.rank
        self.A = nn.Parameter(torch.empty(spec.rank, self.in_dim))
        bound = 1.0 / math.sqrt(self.in_dim)  # kaiming_uniform_(a=√5) on a (r, in) matrix
        with torch.no_grad():
            self.A.uniform_(-bound, bound, generator=generator)
        self.B = nn.Parameter(torch.zeros(self.out_dim, spec.rank))

    def adapted(self, w: torch.Tensor) -> torch.Tensor:
        return lora_weight(w, self.B, self.A, self.scaling)


class ParaLayer(_Adapted):
    """W′ = (I − QQᵀ)W with Q = QR(P) recomputed with gradient, P (out × r) the only trainable piece."""

    def __init__(self, base: nn.Module, spec: AdapterSpec, generator: torch.Generator | None = None) -> None:
        super().__init__(base)
        if not 1 <= spec.rank < self.out_dim:
            raise ValueError(f"rank {spec.rank} must be in [1, {self.out_dim - 1}]")
        self.P = nn.Parameter(torch.randn(self.out_dim, spec.rank, generator=generator) * 0.02)

    def adapted(self, w: torch.Tensor) -> torch.Tensor:
        return para_weight(w, orthonormal_basis(self.P))


_KINDS: dict[str, type[_Adapted]] = {"deft": DeftLayer, "lora": LoraLayer, "para": ParaLayer}


def make_adapter(base: nn.Module, spec: AdapterSpec, generator: torch.Generator | None = None) -> _Adapted:
    return _KINDS[spec.kind](base, spec, generator)


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def wrap_model(model: nn.Module, targets: list[str], spec: AdapterSpec,
               generator: torch.Generator | None = None) -> dict[str, _Adapted]:
    """Freeze ``model`` and replace each named target by an adapter (in place); returns the adapters."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = {}
    for name in targets:
        adapters[name] = make_adapter(model.get_submodule(name), spec, generator)
        _set_submodule(model, name, adapters[name])
    return adapters


def max_rank(kind: str, base: nn.Module) -> int:
    """The largest rank an adapter of ``kind`` accepts on ``base``."""
    out_dim, in_dim = as_matrix(base.weight).shape
    return {"deft": out_dim, "lora": min(out_dim, in_dim), "para": out_dim - 1}[kind]


def nominal_parameters(kind: str, out_dim: int, in_dim: int, rank: int, gate: bool = False) -> int:
    """Trainable (requires_grad) parameters of one adapter: the budget formula of each method."""
    if kind == "deft":
        return rank * (out_dim + in_dim) + int(gate)
    if kind == "lora":
        return rank * (out_dim + in_dim)
    if kind == "para":
        return rank * out_dim
    raise ValueError(f"unknown adapter kind {kind!r}")
