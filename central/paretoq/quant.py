"""ParetoQ's weight quantisers (LSQ, SEQ, sign), the QuantLinear wrapper, byte counting, weight change.

The maths follows the authors' ``models/utils_quant.py`` and ``train.py`` (facebookresearch/ParetoQ);
see the package docstring for the algorithm and the deviations.  Bit widths are given as the paper
writes them (1, 1.58, 2, 3, 4); 1.58 is the ternary case (the authors' ``w_bits=0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

BIT_WIDTHS: tuple[float, ...] = (1.0, 1.58, 2.0, 3.0, 4.0)
TERNARY = 1.58
SEQ_CLIP = 0.99  # the authors' clip_val = 1 - 1e-2 on w / alpha
ALPHA_EPS = 1e-5  # scales below this are clamped to it (the authors' eps)
SEQ_LEVELS = {TERNARY: (-2 / 3, 0.0, 2 / 3), 2.0: (-0.75, -0.25, 0.25, 0.75)}  # in units of α
TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: a byte holds five ternary weights


def canonical_bits(bits: float) -> float:
    """``bits`` as one of :data:`BIT_WIDTHS` (1.58 also accepts log2(3)); ValueError otherwise."""
    for b in BIT_WIDTHS:
        if abs(float(bits) - b) < 1e-6 or (b == TERNARY and abs(float(bits) - math.log2(3)) < 1e-6):
            return b
    raise ValueError(f"bits must be one of {', '.join(f'{b:g}' for b in BIT_WIDTHS)}, got {bits!r}")


def bits_label(bits: float) -> str:
    return f"{canonical_bits(bits):g}"


def _lsq_range(bits: float) -> tuple[int, int]:
    """LSQ's integer range [Qn, Qp]: ±1 for 1 bit and ternary, else [-2^(b-1), 2^(b-1)-1]."""
    if bits in (1.0, TERNARY):
        return -1, 1
    half = 2 ** (int(bits) - 1)
    return -half, half - 1


def _seq_grid(bits: float) -> tuple[float, float]:
    """SEQ's (n_levels, shift): ternary (1.5, 0) -> {0, ±2/3}; 2-bit (2, 0.5) -> {±1/4, ±3/4}."""
    if bits == TERNARY:
        return 1.5, 0.0
    if bits == 2.0:
        return 2.0, 0.5
    raise ValueError(f"SEQ is defined for 1.58 and 2 bits, not {bits:g}")


def _sign(w: torch.Tensor) -> torch.Tensor:
    """±1 (zero maps to +1, so a 1-bit weight has exactly two values)."""
    return torch.where(w >= 0, torch.ones_like(w), -torch.ones_like(w))


def _grad_scale(numel: int, qp: int) -> float:
    """LSQ's gradient scale for the step size: 1/sqrt(numel * Qp) over the *whole* weight matrix."""
    return 1.0 / math.sqrt(numel * qp)


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=-1, keepdim=True)


class LSQ(torch.autograd.Function):
    """Learned step size quantisation as the authors code it for 1, 3 and 4 bits (and ternary/2-bit if asked).

    Forward: ``clamp(round(w/α), Qn, Qp)·α`` (1 bit: ``sign(w)·α``).  Backward: the weight gets the
    straight-through gradient where ``Qn ≤ w/α ≤ Qp`` and zero outside; the per-row step size gets
    ``Σ_row [Qn | Qp | round(w/α) − w/α]·g·s`` (1 bit: ``Σ_row sign(w)·g·s``), s = 1/√(numel·Qp).
    """

    @staticmethod
    def forward(ctx, w: torch.Tensor, alpha: torch.Tensor, bits: float) -> torch.Tensor:  # type: ignore[override]
        alpha = alpha.clamp_min(ALPHA_EPS)
        qn, qp = _lsq_range(bits)
        ctx.save_for_backward(w, alpha)
        ctx.bits, ctx.qn, ctx.qp = bits, qn, qp
        if bits == 1.0:
            return _sign(w) * alpha
        return torch.round(w / alpha).clamp(qn, qp) * alpha

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        w, alpha = ctx.saved_tensors
        qn, qp = ctx.qn, ctx.qp
        v = w / alpha
        small, big = (v < qn).to(grad.dtype), (v > qp).to(grad.dtype)
        middle = 1.0 - small - big
        scale = _grad_scale(w.numel(), qp)
        if ctx.bits == 1.0:
            d_alpha = _sign(w)
        else:
            d_alpha = small * qn + big * qp + middle * (torch.round(v) - v)
        return middle * grad, _row_sum(d_alpha * grad) * scale, None


class SEQ(torch.autograd.Function):
    """Stretched elastic quantisation (ternary and 2-bit) as the authors code it.

    Forward: ``(round(clamp(w/α, −0.99, 0.99)·n − s) + s)/n · α`` with (n, s) = (1.5, 0) for ternary
    and (2, 0.5) for 2 bits.  Backward: straight-through for the weight inside ``|w/α| ≤ 0.99``, zero
    outside; the step size gets ``Σ_row [∓Qp | q(w/α) − w/α]·g·s`` with Qp = (n − s)/n (1 for
    ternary, 3/4 for 2 bits) and s = 1/√numel (the authors' LSQ range for these bits has Qp = 1).
    """

    @staticmethod
    def forward(ctx, w: torch.Tensor, alpha: torch.Tensor, bits: float) -> torch.Tensor:  # type: ignore[override]
        alpha = alpha.clamp_min(ALPHA_EPS)
        ctx.save_for_backward(w, alpha)
        ctx.bits = bits
        return seq_levels(w / alpha, bits) * alpha

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        w, alpha = ctx.saved_tensors
        n, s = _seq_grid(ctx.bits)
        qp = (n - s) / n
        v = w / alpha
        small, big = (v < -SEQ_CLIP).to(grad.dtype), (v > SEQ_CLIP).to(grad.dtype)
        middle = 1.0 - small - big
        scale = _grad_scale(w.numel(), _lsq_range(ctx.bits)[1])
        d_alpha = -small * qp + big * qp + middle * (seq_levels(v, ctx.bits) - v)
        return middle * grad, _row_sum(d_alpha * grad) * scale, None


def seq_levels(v: torch.Tensor, bits: float) -> torch.Tensor:
    """SEQ's level for ``v = w/α`` (in units of α)."""
    n, s = _seq_grid(bits)
    return (torch.round(v.clamp(-SEQ_CLIP, SEQ_CLIP) * n - s) + s) / n


def levels(bits: float, quantizer: str) -> torch.Tensor:
    """The documented level set in units of α (sorted): SEQ {0, ±2/3} / {±1/4, ±3/4}; LSQ ±1 or Qn..Qp."""
    bits = canonical_bits(bits)
    if quantizer == "seq":
        return torch.tensor(SEQ_LEVELS[bits], dtype=torch.float64)
    if bits == 1.0:
        return torch.tensor([-1.0, 1.0], dtype=torch.float64)
    qn, qp = _lsq_range(bits)
    return torch.arange(qn, qp + 1, dtype=torch.float64)


def quantizer_for(bits: float, seq_bits: tuple[float, ...] = (TERNARY, 2.0)) -> str:
    """'seq' for the bit widths in ``seq_bits`` (the authors: ternary and 2 bits), else 'lsq'."""
    bits = canonical_bits(bits)
    return "seq" if bits in {canonical_bits(b) for b in seq_bits} and bits in (TERNARY, 2.0) else "lsq"


def quantize(w: torch.Tensor, alpha: torch.Tensor, bits: float, quantizer: str) -> torch.Tensor:
    """Fake-quantise ``w`` (rows = output channels) with per-row step size ``alpha`` (rows × 1)."""
    fn = SEQ if quantizer == "seq" else LSQ
    return fn.apply(w, alpha, canonical_bits(bits))


@torch.no_grad()
def init_scale(w: torch.Tensor, bits: float) -> torch.Tensor:
    """The authors' initial per-row scale: mean|w| (1 bit), max|w| (ternary, 2 bits), max|w|/(2^(b-1)-1) (3, 4)."""
    bits = canonical_bits(bits)
    if bits == 1.0:
        return w.abs().mean(dim=-1, keepdim=True)
    xmax = w.abs().amax(dim=-1, keepdim=True)
    if bits in (TERNARY, 2.0):
        return xmax
    return xmax / (2 ** (int(bits) - 1) - 1)


class QuantLinear(nn.Module):
    """A weight-only fake-quantised linear layer around an existing ``nn.Linear``'s parameters.

    The latent full-precision weight (the same ``Parameter`` object as the wrapped layer's) is
    trained; the forward pass uses its quantised version.  ``weight_clip_val`` (out × 1) is the
    learnable per-output-channel step size, initialised as the authors do.
    """

    def __init__(self, linear: nn.Linear, bits: float, quantizer: str | None = None) -> None:
        super().__init__()
        self.bits = canonical_bits(bits)
        self.quantizer = quantizer or quantizer_for(self.bits)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight_clip_val = nn.Parameter(init_scale(linear.weight.detach(), self.bits).clone())

    def quantized_weight(self) -> torch.Tensor:
        return quantize(self.weight, self.weight_clip_val, self.bits, self.quantizer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bits={self.bits:g}, quantizer={self.quantizer}"


def block_linear_names(model: nn.Module) -> list[str]:
    """The linear layers the authors quantise: every ``nn.Linear`` inside the transformer blocks
    (q/k/v/o and gate/up/down); embeddings and the LM head stay in full precision."""
    return [name for name, mod in model.named_modules()
            if isinstance(mod, (nn.Linear, QuantLinear)) and ".layers." in f".{name}."]


def quantize_model(model: nn.Module, bits: float, seq_bits: tuple[float, ...] = (TERNARY, 2.0)) -> list[str]:
    """Swap every block linear of ``model`` for a :class:`QuantLinear` in place; returns their names."""
    names = block_linear_names(model)
    quantizer = quantizer_for(bits, seq_bits)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, child)
        if isinstance(layer, nn.Linear):
            setattr(parent, child, QuantLinear(layer, bits, quantizer))
    return names


def block_numel(model: nn.Module) -> int:
    """How many weights the block linears hold."""
    return sum(model.get_submodule(name).weight.numel() for name in block_linear_names(model))


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, QuantLinear)}


# -- model size -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ByteCount:
    quantized_weights: int
    scales: int
    full_precision: int

    @property
    def total(self) -> int:
        return self.quantized_weights + self.scales + self.full_precision


def packed_bytes(numel: int, bits: float) -> int:
    """Bytes to store ``numel`` weights at ``bits``: ceil(numel·b/8); ternary packs 5 weights a byte."""
    bits = canonical_bits(bits)
    if bits == TERNARY:
        return math.ceil(numel / TRITS_PER_BYTE)
    return math.ceil(numel * int(bits) / 8)


def model_bytes(model: nn.Module, fp_bits: int = 16, scale_bits: int = 16) -> ByteCount:
    """Storage of ``model``: each QuantLinear's weight packed at its bit width, its scales at
    ``scale_bits``, every other parameter (embeddings, norms, head; tied ones once) at ``fp_bits``."""
    quant = quant_layers(model)
    q_ids = {id(m.weight) for m in quant.values()}
    s_ids = {id(m.weight_clip_val) for m in quant.values()}
    q_bytes = sum(packed_bytes(m.weight.numel(), m.bits) for m in quant.values())
    s_bytes = sum(math.ceil(m.weight_clip_val.numel() * scale_bits / 8) for m in quant.values())
    rest = sum(p.numel() for p in model.parameters() if id(p) not in q_ids and id(p) not in s_ids)
    return ByteCount(q_bytes, s_bytes, math.ceil(rest * fp_bits / 8))


# -- weight change ----------------------------------------------------------------------------------


@torch.no_grad()
def relative_change(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    """‖after − before‖ / ‖before‖ over all the named matrices together (Frobenius)."""
    num = sum(float((after[k].double() - before[k].double()).pow(2).sum()) for k in before)
    den = sum(float(before[k].double().pow(2).sum()) for k in before)
    return math.sqrt(num / den) if den > 0 else float("nan")


@torch.no_grad()
def block_weights(model: nn.Module, quantized: bool = False) -> dict[str, torch.Tensor]:
    """The block linears' weights by layer name: latent weights, or their quantised values."""
    out = {}
    for name in block_linear_names(model):
        mod = model.get_submodule(name)
        if quantized and isinstance(mod, QuantLinear):
            out[name] = mod.quantized_weight().detach().clone()
        else:
            out[name] = mod.weight.detach().clone()
    return out
