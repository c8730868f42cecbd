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

Two implementations of the same formula:

* :func:`interpolate` — the **fused** lookup (the model's path, training and inference): per chunk of
  pixels the flat index of every cell origin is computed once, all 2ⁿ corners of all G tables and
  all C_out outputs are fetched by ONE ``index_select`` on the flattened tables (int32 index
  arithmetic: origin + a constant corner offset + the table's offset), and the n-linear reduction
  is n batched ``torch.lerp`` calls, each halving the corner axis (last input axis first).  No
  Python loop over corners, channels or tables; only over chunks of :data:`FUSED_CHUNK` pixels,
  which bound the (C_out, 2ⁿ, G, chunk) corner tensor so it stays in cache for whole large images.
* :func:`interpolate_lerp` — the previous path, kept as a reference: a depth-first recursion over
  the 2ⁿ corners with one 1-D ``index_select`` per corner and output channel and one lerp per pair,
  looped over the G tables and chunks of :data:`CHUNK` pixels.  The fused path performs the same
  lerps in the same order, so the two agree bit for bit (tested).

Throughput (1 thread, retina 1408² whole, ``benchmarks/panlut_lookup.py``, 2 shared cores under
load average 5–6): the whole Pan-LUT forward runs at 0.97–1.07× the reference's MP/s with the fused
lookup (two runs); the lookups alone at 0.65–1.25× depending on the LUT kind and the load.  No gain
beyond noise: the reference was already vectorised over pixels (its Python loop is over 2ⁿ corners
× outputs per 65K-pixel chunk, ~128 calls), so fusing removes dispatch, not the memory passes over
the 2ⁿ corner values that dominate; about half of an SD stage's time is outside the lookup (rot90,
padding, plane copies).
"""

from __future__ import annotations

from typing import Sequence

import torch

#: Pixels per chunk in :func:`interpolate_lerp` (bounds the memory of the 2ⁿ weight planes).
CHUNK = 1 << 16
#: Pixels per chunk in :func:`interpolate` (the fused corner tensor is C_out·2ⁿ·G·chunk values;
#: 4096 was the fastest of 1K–64K on one CPU thread for both the 5-D and the grouped 4-D LUTs).
FUSED_CHUNK = 1 << 12
#: Index dtype of the fused gather (int32 is faster than int64 on CPU; tables have < 2³¹ entries).
INDEX = torch.int32


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


def corner_offsets(n: int, dim: int) -> torch.Tensor:
    """Flat-index offsets of the 2ⁿ cell corners from the cell origin, shape (2ⁿ,).

    Corner j has bit k of j set when it takes the upper vertex on axis k (stride d^(n−1−k)), so the
    last axis is the most significant bit: halving the corner axis splits along axis n−1 first,
    which is the order in which :func:`interpolate_lerp` reduces."""
    strides = [dim ** (n - 1 - k) for k in range(n)]
    return torch.tensor([sum(s for k, s in enumerate(strides) if j >> k & 1) for j in range(2 ** n)], dtype=INDEX)


def interpolate(tables: torch.Tensor, coords: Sequence[torch.Tensor]) -> torch.Tensor:
    """Fused n-linear lookup: ``tables`` (G, C_out, d, …, d), ``coords`` n tensors (G, N) → (G, N, C_out).

    One gather of all corners × tables × outputs per chunk, then n batched lerps (see the module
    docstring); equal to :func:`interpolate_lerp`."""
    n = tables.dim() - 2
    if len(coords) != n:
        raise ValueError(f"a {n}-D LUT needs {n} coordinates, got {len(coords)}")
    g, c_out, dim = tables.shape[0], tables.shape[1], tables.shape[2]
    cells = dim ** n
    if g * cells >= 2 ** 31:
        raise ValueError(f"LUT group too large for int32 indices: {g} x {cells} cells")
    flat = tables.reshape(g, c_out, cells).transpose(0, 1).reshape(c_out, g * cells)   # (C_out, G·dⁿ)
    offsets = corner_offsets(n, dim).view(-1, 1, 1)                                      # (2ⁿ, 1, 1)
    table_origin = (torch.arange(g, dtype=INDEX) * cells).view(g, 1)                     # (G, 1)
    npx = coords[0].shape[1]
    parts = []
    for i in range(0, npx, FUSED_CHUNK):
        origin: torch.Tensor = table_origin
        fracs = []
        for k, v in enumerate(coords):
            pos = v[:, i:i + FUSED_CHUNK] * (dim - 1)
            b = torch.clamp(torch.floor(pos.detach()), 0, dim - 2)
            fracs.append(pos - b)
            origin = origin + b.to(INDEX) * dim ** (n - 1 - k)
        m = origin.shape[1]
        corners = flat.index_select(1, (origin + offsets).reshape(-1)).view(c_out, 2 ** n, g, m)
        for k in reversed(range(n)):                    # axis n−1 first, as the reference recursion
            half = corners.shape[1] // 2
            corners = torch.lerp(corners[:, :half], corners[:, half:], fracs[k])
        parts.append(corners[:, 0])                     # (C_out, G, m)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.permute(1, 2, 0)


def interpolate_lerp(tables: torch.Tensor, coords: Sequence[torch.Tensor]) -> torch.Tensor:
    """The reference lookup (per-corner, per-channel 1-D gathers; same signature and result as
    :func:`interpolate`)."""
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
