"""The polynomial network map: widths (d_0, …, d_L), activation x^r, with or without biases.

``f_θ(x) = W_L σ(W_{L−1} σ(… σ(W_1 x + b_1) …) + b_{L−1}) + b_L`` with ``σ(t) = t^r`` applied
entrywise after every hidden layer (none after the output layer).  The output is a vector of d_L
polynomials of degree ``D = r^{L−1}`` in d_0 variables, homogeneous when there are no biases.

Parameters travel as one flat vector, layer by layer: ``W_l`` row-major, then ``b_l`` (if biased).
This module evaluates the map in floating point (numpy or torch, same code), over the integers
modulo a prime, and expands it exactly into its coefficient vector (Fractions; small cases only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator

import numpy as np

from fedsim.errors import ConfigError


@dataclass(frozen=True)
class Arch:
    """An architecture: widths (d_0, …, d_L), one activation degree r for every hidden layer, biases or not."""

    widths: tuple[int, ...]
    r: int
    bias: bool = False

    @property
    def L(self) -> int:
        return len(self.widths) - 1

    @property
    def hidden(self) -> tuple[int, ...]:
        return self.widths[1:-1]

    @property
    def degree(self) -> int:
        """Degree D = r^{L−1} of the output polynomials."""
        return self.r ** (self.L - 1)

    @property
    def n_params(self) -> int:
        return sum(d_out * (d_in + int(self.bias)) for d_in, d_out in zip(self.widths, self.widths[1:]))

    @property
    def name(self) -> str:
        return "-".join(map(str, self.widths))

    @property
    def label(self) -> str:
        return f"{self.name} r={self.r}" + (" +bias" if self.bias else "")

    def layer_slices(self) -> Iterator[tuple[int, int, int]]:
        """(offset, d_in, d_out) of each layer's block in the flat parameter vector."""
        offset = 0
        for d_in, d_out in zip(self.widths, self.widths[1:]):
            yield offset, d_in, d_out
            offset += d_out * (d_in + int(self.bias))


def parse_widths(text: str | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """``"3-2-1"`` (or a list) → (3, 2, 1); a one-line ConfigError for anything else."""
    try:
        widths = tuple(int(w) for w in (text.split("-") if isinstance(text, str) else text))
    except (TypeError, ValueError):
        raise ConfigError(f"bad architecture {text!r}: write the widths as d0-d1-...-dL, e.g. 3-2-1") from None
    if len(widths) < 3 or min(widths) < 1:
        raise ConfigError(f"bad architecture {text!r}: need >= 3 widths (one hidden layer or more), all >= 1")
    return widths


def layers(arch: Arch, theta: Any) -> list[tuple[Any, Any]]:
    """The (W_l, b_l) of a flat parameter vector (b_l is None without biases); views, not copies."""
    if theta.shape[-1] != arch.n_params:
        raise ValueError(f"{arch.label}: expected {arch.n_params} parameters, got {theta.shape[-1]}")
    out = []
    for offset, d_in, d_out in arch.layer_slices():
        W = theta[offset : offset + d_out * d_in].reshape(d_out, d_in)
        b = theta[offset + d_out * d_in : offset + d_out * (d_in + 1)] if arch.bias else None
        out.append((W, b))
    return out


def forward(arch: Arch, theta: Any, X: Any) -> Any:
    """f_θ at the rows of X, shape (N, d_L); works for numpy arrays and torch tensors alike."""
    h = X
    for l, (W, b) in enumerate(layers(arch, theta), start=1):
        h = h @ W.T
        if b is not None:
            h = h + b
        if l < arch.L:
            h = h**arch.r
    return h


# -- modular arithmetic ---------------------------------------------------------------------------

MAX_PRIME = 2**31  # every product of two residues stays below 2^62: exact in int64


def powmod(a: np.ndarray, e: int, p: int) -> np.ndarray:
    """Entrywise a^e mod p (int64, square and multiply)."""
    result = np.ones_like(a)
    base = a % p
    while e:
        if e & 1:
            result = result * base % p
        base = base * base % p
        e >>= 1
    return result


def forward_mod(arch: Arch, theta: np.ndarray, X: np.ndarray, p: int) -> np.ndarray:
    """f_θ(X) mod p with integer parameters and points (int64 arrays, entries in [0, p))."""
    h = X % p
    for l, (W, b) in enumerate(layers(arch, theta), start=1):
        z = np.zeros((h.shape[0], W.shape[0]), dtype=np.int64) if b is None else np.tile(b % p, (h.shape[0], 1))
        for k in range(W.shape[1]):
            z = (z + h[:, k, None] * W[None, :, k]) % p
        h = powmod(z, arch.r, p) if l < arch.L else z
    return h


# -- exact expansion ------------------------------------------------------------------------------

Poly = dict[tuple[int, ...], Fraction]  # exponent vector → coefficient


def _poly_mul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ea, ca in a.items():
        for eb, cb in b.items():
            e = tuple(i + j for i, j in zip(ea, eb))
            out[e] = out.get(e, Fraction(0)) + ca * cb
    return {e: c for e, c in out.items() if c != 0}


def _poly_pow(a: Poly, n: int, n_vars: int) -> Poly:
    result: Poly = {(0,) * n_vars: Fraction(1)}
    for _ in range(n):
        result = _poly_mul(result, a)
    return result


def _poly_lin(coeffs: list[Poly], weights: list[Fraction], const: Fraction, n_vars: int) -> Poly:
    out: Poly = {(0,) * n_vars: const} if const else {}
    for poly, w in zip(coeffs, weights):
        if w == 0:
            continue
        for e, c in poly.items():
            out[e] = out.get(e, Fraction(0)) + w * c
    return {e: c for e, c in out.items() if c != 0}


def expand(arch: Arch, theta: list[Fraction] | list[int]) -> list[Poly]:
    """The d_L output polynomials of f_θ, expanded exactly (Fractions); tiny cases only."""
    theta = np.array([Fraction(t) for t in theta], dtype=object)
    n = arch.widths[0]
    h: list[Poly] = [{tuple(int(i == j) for i in range(n)): Fraction(1)} for j in range(n)]
    for l, (W, b) in enumerate(layers(arch, theta), start=1):
        z = [_poly_lin(h, list(W[i]), b[i] if b is not None else Fraction(0), n) for i in range(W.shape[0])]
        h = [_poly_pow(zi, arch.r, n) for zi in z] if l < arch.L else z
    return h


def monomials(n_vars: int, degree: int, homogeneous: bool) -> list[tuple[int, ...]]:
    """Exponent vectors of the monomials of the given degree (all degrees ≤ it if not homogeneous)."""
    degrees = [degree] if homogeneous else range(degree + 1)
    out: list[tuple[int, ...]] = []

    def rec(prefix: tuple[int, ...], left: int, slots: int) -> None:
        if slots == 1:
            out.append(prefix + (left,))
            return
        for k in range(left, -1, -1):
            rec(prefix + (k,), left - k, slots - 1)

    for deg in degrees:
        rec((), deg, n_vars)
    return out


def coefficients(arch: Arch, theta: list[Fraction] | list[int]) -> list[Fraction]:
    """The coefficient vector of f_θ in the monomial basis (outputs stacked), exact."""
    polys = expand(arch, theta)
    basis = monomials(arch.widths[0], arch.degree, homogeneous=not arch.bias)
    return [poly.get(e, Fraction(0)) for poly in polys for e in basis]


def transform(arch: Arch, theta: np.ndarray, scales: list[Any], perms: list[Any], p: int | None = None) -> np.ndarray:
    """Apply the symmetry group: hidden neuron j of layer l becomes old neuron ``perms[l][j]`` times ``scales[l][j]``.

    Its incoming row (and bias) is multiplied by t, its outgoing column by t^{−r}, so f is unchanged.
    With ``p`` the arithmetic is modulo p (t^{−r} is a modular inverse); otherwise floating point.
    """
    out = theta.copy()
    new = layers(arch, out)
    old = layers(arch, theta)
    col_perm: Any = np.arange(arch.widths[0])
    col_scale: Any = np.ones(arch.widths[0], dtype=out.dtype)
    for l, ((W, b), (W0, b0)) in enumerate(zip(new, old)):
        hidden = l < arch.L - 1
        perm = np.asarray(perms[l]) if hidden else np.arange(W.shape[0])
        t = np.asarray(scales[l], dtype=out.dtype) if hidden else np.ones(W.shape[0], dtype=out.dtype)
        rows = W0[perm][:, col_perm] * col_scale[None, :]
        if p:
            rows = rows % p
        W[...] = (rows * t[:, None]) % p if p else rows * t[:, None]
        if b is not None:
            b[...] = (b0[perm] * t) % p if p else b0[perm] * t
        if hidden:
            col_perm = perm
            col_scale = (np.array([pow(int(v), -arch.r, p) for v in t], dtype=out.dtype) if p
                         else t ** (-float(arch.r)))
    return out


def ambient_dim(arch: Arch) -> int:
    """Dimension of the space the output lives in: d_L · #monomials (of degree D, or ≤ D with biases)."""
    d0, D = arch.widths[0], arch.degree
    per_output = math.comb(d0 + D - 1, D) if not arch.bias else math.comb(d0 + D, D)
    return arch.widths[-1] * per_output


__all__ = ["Arch", "parse_widths", "layers", "forward", "forward_mod", "powmod", "expand", "coefficients",
           "monomials", "transform", "ambient_dim", "MAX_PRIME"]
