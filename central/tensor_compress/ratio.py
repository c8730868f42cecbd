"""Parameter counts of the factorised convs and the ranks that meet a compression ratio.

A k×k conv C_in → C_out has ``C_in·C_out·k²`` weights; its Tucker-2 form (1×1, k×k, 1×1)
``C_in·r_in + r_in·r_out·k² + r_out·C_out`` and its CP form (1×1, depthwise k×k, 1×1)
``R·(C_in + k² + C_out)``.
The compression ratio is original ÷ factorised.  Tucker-2 keeps the same fraction α of both channel
dimensions (r_in = α·C_in, r_out = α·C_out, the positive root of the quadratic for the target size);
ranks are rounded so that every layer is compressed at least by the target ratio (at least rank 1).
"""

from __future__ import annotations

import math


def conv_params(c_in: int, c_out: int, k2: int) -> int:
    return c_in * c_out * k2


def tucker2_params(c_in: int, c_out: int, k2: int, r_in: int, r_out: int) -> int:
    return c_in * r_in + r_in * r_out * k2 + r_out * c_out


def cp_params(c_in: int, c_out: int, k2: int, rank: int) -> int:
    return rank * (c_in + k2 + c_out)


def tucker2_ranks(c_in: int, c_out: int, k2: int, ratio: float) -> tuple[int, int]:
    """(r_in, r_out) with at most ``conv_params / ratio`` weights (at least rank 1 each).

    α solves ``C_in·C_out·k²·α² + (C_in² + C_out²)·α = target``; of the four roundings of
    (α·C_in, α·C_out) the largest within the budget is taken (ties: the more balanced), else (1, 1).
    """
    target = conv_params(c_in, c_out, k2) / ratio
    a, b = c_in * c_out * k2, c_in * c_in + c_out * c_out  # a·α² + b·α = target
    alpha = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    def roundings(dim: int) -> set[int]:
        return {min(dim, max(1, math.floor(alpha * dim))), min(dim, max(1, math.ceil(alpha * dim)))}

    options = [(r_in, r_out) for r_in in roundings(c_in) for r_out in roundings(c_out)
               if tucker2_params(c_in, c_out, k2, r_in, r_out) <= target]
    if not options:
        return 1, 1
    return max(options, key=lambda r: (tucker2_params(c_in, c_out, k2, *r), -abs(r[0] / c_in - r[1] / c_out)))


def cp_rank(c_in: int, c_out: int, k2: int, ratio: float) -> int:
    """The largest R with at most ``conv_params / ratio`` weights (at least 1)."""
    return max(1, math.floor(conv_params(c_in, c_out, k2) / ratio / (c_in + k2 + c_out) + 1e-9))
