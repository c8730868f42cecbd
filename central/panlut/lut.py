"""n-linear look-up-table interpolation in pure PyTorch (a gather over the 2ⁿ cell vertices).

A LUT group is a tensor ``tables`` of shape ``(G, C_out, d, …, d)`` (n axes of size ``d``): G
independent tables (one per channel for the spatial-details LUT, G = 1 otherwise), each mapping n
coordinates in [0, 1] to C_out values; axis k of a table is indexed by coordinate k.  As in the
authors' CUDA kernels (``Generator5DLUT`` …), coordinate v falls into

    bin = clamp(⌊v·(d−1)⌋, 0, d−2),   frac = v·(d−1) − bin,

and the output is Σ over the 2ⁿ vertices of the cell of (Π_k frac_k or 1 − frac_k) · table[vertex].
v is not clamped: a value slightly outside [0, 1] extrapolates the border cell linearly (indices
never leave the table).  Gradients flow to the table (index_select's backward is a scatter-add) and
to the coordinates (through frac), so LUTs can be chained and trained end to end.

Vectorisation: the flat index of the cell's origin is computed once per pixel; vertex ``bits`` adds
the constant offset Σ_k bits_k·stride_k, so the only Python loops are over the 2ⁿ vertices (32 for
a 5-D LUT), the G tables and chunks of pixels, never over pixels.  The 2ⁿ gathered values are
combined by 2ⁿ − 1 ``torch.lerp`` calls (one axis at a time, depth first), which is algebraically
the n-linear weighted sum and needs half the memory passes of explicit vertex weights.  Pixels are
processed in chunks of :data:`CHUNK` so the working set stays in cache for whole large images.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: Pixels per chunk in :func:`interpolate` (bounds the memory of the 2ⁿ weight planes).
CHUNK = 1 << 16


def identity_tables(groups: int, n_in: int, dim: int, outputs: Sequence[int]) -> torch.Tensor:
    """Tables (groups, len(outputs), dim, …, dim) whose output j equals input coordinate outputs[j].

    n-linear interpolation reproduces any affine function exactly, so these LUTs are the identity
    on the selected coordinates (for inputs in [0, 1])."""
    if dim < 2:
        raise ValueError(f"a LUT needs dim >= 2, got {dim}")
    grid = torch.linspace(0.0, 1.0, dim)
    planes = []
    for k in outputs:
        shape = [1] * n_in
        shape[k] = dim
        planes.append(grid.reshape(shape).expand([dim] * n_in))
    one = torch.stack(planes)                                  # (C_out, d, …, d)
    return one.unsqueeze(0).repeat(groups, *[1] * one.dim()).contiguous()


def _lerp_tree(flat: torch.Tensor, base: torch.Tensor, fracs: Sequence[torch.Tensor], strides: Sequence[int],
               k: int = 0, off: int = 0) -> list[torch.Tensor]:
    """Depth-first n-linear interpolation: gather the 2ⁿ vertices, lerp along axis k on the way up.

    ``lerp(lo, hi, frac_k)`` over axis k of the two half-cells is exactly the n-linear formula
    Σ_vertices Π_k (frac_k or 1 − frac_k)·table[vertex]; depth-first keeps only n partial results.
    Returns one tensor per output channel."""
    if k == len(strides):
        idx = base + off if off else base
        return [flat[c].index_select(0, idx) for c in range(flat.shape[0])]   # 1-D gathers: fastest on CPU
    lo = _lerp_tree(flat, base, fracs, strides, k + 1, off)
    hi = _lerp_tree(flat, base, fracs, strides, k + 1, off + strides[k])
    return [torch.lerp(a, b, fracs[k]) for a, b in zip(lo, hi)]


def _interpolate_1d(flat: torch.Tensor, coords: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """One table ``flat`` (C_out, dⁿ) at N points (n coordinate tensors of shape (N,)) → (N, C_out)."""
    n = len(coords)
    strides = [dim ** (n - 1 - k) for k in range(n)]
    base: torch.Tensor | int = 0
    fracs = []
    for v, s in zip(coords, strides):
        pos = v * (dim - 1)
        b = torch.clamp(torch.floor(pos.detach()), 0, dim - 2)
        fracs.append(pos - b)
        base = base + b.long() * s
    return torch.stack(_lerp_tree(flat, base, fracs, strides), dim=-1)  # type: ignore[arg-type]


def interpolate(tables: torch.Tensor, coords: Sequence[torch.Tensor]) -> torch.Tensor:
    """n-linear lookup: ``tables`` (G, C_out, d, …, d), ``coords`` n tensors (G, N) → (G, N, C_out)."""
    n = tables.dim() - 2
    if len(coords) != n:
        raise ValueError(f"a {n}-D LUT needs {n} coordinates, got {len(coords)}")
    g, c_out, dim = tables.shape[0], tables.shape[1], tables.shape[2]
    flat = tables.reshape(g, c_out, dim ** n)
    npx = coords[0].shape[1]
    groups = []
    for j in range(g):
        parts = [_interpolate_1d(flat[j], [c[j, i:i + CHUNK] for c in coords], dim) for i in range(0, npx, CHUNK)]
        groups.append(parts[0] if len(parts) == 1 else torch.cat(parts))
    return torch.stack(groups)


def interpolate_reference(table: torch.Tensor, point: Sequence[float]) -> torch.Tensor:
    """The same lookup for ONE point and one table (C_out, d, …, d), by explicit loops (for tests)."""
    import itertools

    dim = table.shape[1]
    bins, fracs = [], []
    for v in point:
        b = min(max(int(torch.floor(torch.tensor(v * (dim - 1))).item()), 0), dim - 2)
        bins.append(b)
        fracs.append(v * (dim - 1) - b)
    out = torch.zeros(table.shape[0], dtype=torch.float64)
    for bits in itertools.product((0, 1), repeat=len(point)):
        w = 1.0
        for f, bit in zip(fracs, bits):
            w *= f if bit else 1.0 - f
        out += w * table[(slice(None), *[b + bit for b, bit in zip(bins, bits)])].double()
    return out


def curvature(tables: torch.Tensor) -> torch.Tensor:
    """Mean squared second difference of the tables along every input axis.

    Zero for any affine table (the identity initialisation included), so it does not pull the LUT
    towards a constant; it spreads what visited cells learn to their unvisited neighbours."""
    total = tables.new_zeros(())
    for axis in range(2, tables.dim()):
        n = tables.shape[axis]
        if n < 3:
            continue
        d2 = tables.narrow(axis, 2, n - 2) - 2 * tables.narrow(axis, 1, n - 2) + tables.narrow(axis, 0, n - 2)
        total = total + d2.pow(2).mean()
    return total


def lut_params(groups: int, outputs: int, n_in: int, dim: int) -> int:
    """Entries of a LUT group: G · C_out · dⁿ."""
    return groups * outputs * dim ** n_in


def lut_ops_per_pixel(outputs: int, n_in: int) -> int:
    """Multiply-adds per pixel of one lookup: 2ⁿ vertices × C_out plus the 2ⁿ⁺¹ − 2 weight products."""
    return (2 ** n_in) * outputs + 2 ** (n_in + 1) - 2
