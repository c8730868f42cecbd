"""Dimension counts, verdicts, the two-layer blocks and Kruskal-type sufficient conditions.

* **Symmetries.**  Each hidden neuron has a scaling symmetry — incoming row (and bias) × t, outgoing
  column × t^{−r} — and each hidden layer the (finite) permutations of its neurons, so the symmetry
  group has dimension Σ_{hidden} d_l, with or without biases (r ≥ 2).
* **Expected dimension** of the neurovariety (Kileel–Trager–Bruna; the paper settles the conjecture):
  ``min(#params − Σ_hidden d_l, ambient)``, ambient = d_L·C(d_0+D−1, D) (homogeneous of degree
  D = r^{L−1}) or d_L·C(d_0+D, D) (all degrees ≤ D, with biases).
* **Verdict** from the generic Jacobian rank ρ: *identifiable* (finitely, up to the symmetries) iff
  ρ = #params − Σ_hidden d_l; otherwise *filling* (ρ = ambient: over-parameterised, the expected
  dimension is reached) or *defective* (ρ below the expected dimension).
* **Blocks.**  The paper's localisation theorem: an L-layer PNN is identifiable iff every two-layer
  block (d_{l−1}, d_l, d_{l+1}) with degree r is.  We test each block as a stand-alone two-layer PNN
  (with biases if the network has them) and report the AND beside the whole-network verdict.
* **Kruskal-type sufficient condition** per block [I: our derivation from the paper's connection to
  partially symmetric CP; the paper's exact propositions were not available offline].  Without
  biases, block l is the partially symmetric CP ``Σ_i w_i^{⊗r} ⊗ v_i`` of rank R = d_l with generic
  k-ranks min(d_{l−1}, R) for the w's and min(d_{l+1}, R) for the v's.  Grouping the r symmetric
  modes into m ≥ 2 parts of sizes s_1, …, s_m (a part of size s has the k-rank min(C(n+s−1, s), R)
  of generic Veronese points) and keeping v as the last group, Kruskal's theorem gives uniqueness
  when Σ k ≥ 2R + m.  ``best=False`` is the plain (r+1)-way version r·min(d_{l−1}, R) + min(d_{l+1}, R)
  ≥ 2R + r (all parts of size 1); ``best=True`` takes the best grouping.  With biases the block is homogenised (input
  d_{l−1}+1 incl. the homogenising variable, R = d_l + 1 with the pass-through term e_z^{⊗r} ⊗ (b; 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from central.pnn_ident.pnn import Arch, ambient_dim


def symmetry_dim(arch: Arch) -> int:
    return sum(arch.hidden)


def upper_bound(arch: Arch) -> int:
    """#params − dim(symmetry group): the largest possible Jacobian rank, reached iff identifiable."""
    return arch.n_params - symmetry_dim(arch)


def expected_dim(arch: Arch) -> int:
    return min(upper_bound(arch), ambient_dim(arch))


def count_condition(arch: Arch) -> bool:
    """Necessary condition for finite identifiability: #params − #symmetries ≤ ambient dimension."""
    return upper_bound(arch) <= ambient_dim(arch)


def counts_ok(arch: Arch) -> bool:
    """The counting condition for the network and for each of its blocks (necessary, by localisation)."""
    return count_condition(arch) and all(count_condition(b) for b in blocks(arch))


def blocks(arch: Arch) -> list[Arch]:
    """The two-consecutive-layer blocks (d_{l−1}, d_l, d_{l+1}), l = 1 … L−1, as stand-alone PNNs."""
    w = arch.widths
    return [Arch((w[l - 1], w[l], w[l + 1]), arch.r, arch.bias) for l in range(1, arch.L)]


@dataclass(frozen=True)
class Verdict:
    rank: int
    bound: int
    ambient: int

    @property
    def expected(self) -> int:
        return min(self.bound, self.ambient)

    @property
    def identifiable(self) -> bool:
        return self.rank == self.bound

    @property
    def defect(self) -> int:
        """Expected dimension minus the rank (0 = non-defective)."""
        return self.expected - self.rank

    @property
    def fiber_dim(self) -> int:
        """Dimension of a generic fibre modulo the symmetries (0 = finitely identifiable)."""
        return self.bound - self.rank

    @property
    def kind(self) -> str:
        if self.identifiable:
            return "identifiable"
        return "filling" if self.defect == 0 else "defective"

    @property
    def short(self) -> str:
        return {"identifiable": "I", "filling": "F"}.get(self.kind, f"D{self.defect}")


def verdict(arch: Arch, rank: int) -> Verdict:
    if rank > upper_bound(arch) or rank > ambient_dim(arch):
        raise AssertionError(f"{arch.label}: rank {rank} exceeds min(bound, ambient) — a bug")
    return Verdict(rank, upper_bound(arch), ambient_dim(arch))


# -- Kruskal-type sufficient conditions -------------------------------------------------------------

def _block_kranks(block: Arch) -> tuple[int, int, int]:
    """(input dimension n of the symmetric factor, rank R, k-rank of the output factor) of a block."""
    d_in, d_mid, d_out = block.widths
    if block.bias:
        return d_in + 1, d_mid + 1, min(d_out, d_mid + 1)
    return d_in, d_mid, min(d_out, d_mid)


def _veronese_krank(n: int, s: int, R: int) -> int:
    return min(math.comb(n + s - 1, s), R)


def _partitions(r: int, largest: int | None = None) -> list[tuple[int, ...]]:
    largest = r if largest is None else largest
    if r == 0:
        return [()]
    return [(k,) + rest for k in range(min(r, largest), 0, -1) for rest in _partitions(r - k, k)]


@lru_cache(maxsize=None)
def _kruskal(n: int, R: int, k_out: int, r: int, best: bool) -> bool:
    if R <= 1:
        return True
    if not best:
        return r * min(n, R) + k_out >= 2 * R + r
    for parts in _partitions(r):
        ks = [_veronese_krank(n, s, R) for s in parts]
        if len(ks) >= 2 and sum(ks) + k_out >= 2 * R + len(ks):  # len(ks) + 1 groups, v alone
            return True
    return False


def kruskal_block(block: Arch, best: bool = True) -> bool:
    n, R, k_out = _block_kranks(block)
    return _kruskal(n, R, k_out, block.r, best)


def kruskal(arch: Arch, best: bool = True) -> bool:
    """Every block satisfies the Kruskal-type condition (sufficient for identifiability)."""
    return all(kruskal_block(b, best) for b in blocks(arch))


__all__ = ["symmetry_dim", "upper_bound", "expected_dim", "count_condition", "counts_ok", "blocks", "Verdict",
           "verdict",
           "kruskal_block", "kruskal"]
