"""Exactness, conventions and edge cases of the batched FedSVD refactorisation kernel."""

from __future__ import annotations

import importlib
from collections import OrderedDict

import pytest
import torch

from fedsim.kernels import (
    orthonormal_rows_mask,
    refactor_lora_state_dict,
    svd_refactor,
    svd_refactor_reference,
)

# The package re-exports the function `svd_refactor`, which shadows the submodule attribute.
sr = importlib.import_module("fedsim.kernels.lowrank_svd")

SV_RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}
RECON_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _pair(L: int, m: int, r: int, n: int, dtype: torch.dtype = torch.float64, seed: int = 0):
    """Well-conditioned random (B, A) with m, n >> r."""
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(L, m, r, generator=g, dtype=torch.float64)
    A = torch.randn(L, r, n, generator=g, dtype=torch.float64) / n**0.5
    return B.to(dtype), A.to(dtype)


def _orthonormal_rows(L: int, r: int, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(L, n, r, generator=g, dtype=torch.float64))
    return Q.mT.contiguous()


def _singular_values(B_new: torch.Tensor) -> torch.Tensor:
    return B_new.double().norm(dim=-2)


def _max_rel(X: torch.Tensor, Y: torch.Tensor) -> float:
    return float((X.double() - Y.double()).abs().amax() / Y.double().abs().amax())


def _ortho_error(A_new: torch.Tensor) -> float:
    A = A_new.double()
    return float((A @ A.mT - torch.eye(A.shape[-2], dtype=torch.float64)).abs().amax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shortcut", [None, False])
def test_singular_values_match_svd_of_product(dtype, shortcut):
    B, A = _pair(4, 96, 8, 80, dtype)
    B_new, _ = svd_refactor(B, A, assume_orthonormal_A=shortcut)
    truth = torch.linalg.svdvals(B.double() @ A.double())[..., :8]
    torch.testing.assert_close(_singular_values(B_new), truth, rtol=SV_RTOL[dtype], atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_product_kept_and_factors_orthogonal(dtype):
    B, A = _pair(4, 96, 8, 80, dtype)
    B_new, A_new = svd_refactor(B, A)
    assert _max_rel(B_new @ A_new, B @ A) < RECON_RTOL[dtype]
    assert _ortho_error(A_new) < 10 * torch.finfo(dtype).eps * 80**0.5
    gram = B_new.double().mT @ B_new.double()
    off_diag = gram - torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1))
    assert float(off_diag.abs().amax() / gram.abs().amax()) < RECON_RTOL[dtype]
    s = _singular_values(B_new)
    assert bool((s[..., :-1] >= s[..., 1:]).all())


def test_batched_equals_per_layer():
    B, A = _pair(5, 40, 6, 30)
    B_new, A_new = svd_refactor(B, A)
    for i in range(5):
        b_i, a_i = svd_refactor(B[i], A[i])
        assert b_i.shape == (40, 6) and a_i.shape == (6, 30)
        torch.testing.assert_close(B_new[i], b_i, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(A_new[i], a_i, rtol=1e-12, atol=1e-12)


def test_shortcut_equals_general_path():
    B, _ = _pair(3, 64, 8, 48)
    A = _orthonormal_rows(3, 8, 48)
    fast = svd_refactor(B, A, assume_orthonormal_A=True)
    general = svd_refactor(B, A, assume_orthonormal_A=False)
    for x, y in zip(fast, general, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_auto_detection_picks_the_path(monkeypatch):
    seen: list[bool] = []
    core = sr._refactor_core

    def spy(B, A, *, shortcut, finalize):
        seen.append(shortcut)
        return core(B, A, shortcut=shortcut, finalize=finalize)

    monkeypatch.setattr(sr, "_refactor_core", spy)
    B, A = _pair(2, 32, 4, 24)
    svd_refactor(B, _orthonormal_rows(2, 4, 24))
    _, A_new = svd_refactor(B, A)
    assert seen == [True, False]
    assert _ortho_error(A_new) < 1e-12  # the general path re-orthonormalised A


def test_orthonormal_rows_mask_per_layer():
    A = _orthonormal_rows(3, 4, 20)
    A[1] *= 1.001
    assert orthonormal_rows_mask(A).tolist() == [True, False, True]
    assert orthonormal_rows_mask(A.float()).tolist() == [True, False, True]


def test_shortcut_keeps_a_orthonormal_over_rounds():
    B, A = _pair(2, 48, 4, 40, torch.float32)
    g = torch.Generator().manual_seed(3)
    B, A = svd_refactor(B, A)
    for _ in range(30):
        B, A = svd_refactor(B + 0.1 * torch.randn(B.shape, generator=g), A)
    assert _ortho_error(A) < 1e-5


@pytest.mark.parametrize("shortcut", [True, False])
def test_equals_reference_including_signs(shortcut):
    B, _ = _pair(3, 50, 6, 40)
    A = _orthonormal_rows(3, 6, 40)
    ours = svd_refactor(B, A, assume_orthonormal_A=shortcut)
    ref = svd_refactor_reference(B, A)
    for x, y in zip(ours, ref, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)


def test_equals_reference_float32_general_a():
    B, A = _pair(2, 64, 8, 64, torch.float32)
    ours = svd_refactor(B, A)
    ref = svd_refactor_reference(B, A)
    for x, y in zip(ours, ref, strict=True):
        assert _max_rel(x, y) < 1e-4


def test_sign_convention_and_determinism():
    B, A = _pair(3, 30, 5, 25)
    B_new, A_new = svd_refactor(B, A)
    idx = A_new.abs().argmax(dim=-1, keepdim=True)
    assert bool((A_new.gather(-1, idx) > 0).all())
    again = svd_refactor(B.clone(), A.clone())
    assert torch.equal(again[0], B_new) and torch.equal(again[1], A_new)
    flipped = svd_refactor(-B, A)  # same product up to sign: U flips, V does not
    torch.testing.assert_close(flipped[1], A_new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_b_keeps_row_space_of_a(dtype):
    _, A = _pair(3, 20, 4, 30, dtype)
    B = torch.zeros(3, 20, 4, dtype=dtype)
    B_new, A_new = svd_refactor(B, A)
    assert not torch.isnan(A_new).any() and not torch.isnan(B_new).any()
    assert torch.equal(B_new, torch.zeros_like(B_new))
    assert _ortho_error(A_new) < 10 * torch.finfo(dtype).eps * 30**0.5
    residual = A.double() - A.double() @ A_new.double().mT @ A_new.double()
    assert float(residual.abs().amax()) < 1e3 * torch.finfo(dtype).eps
    ref_B, ref_A = svd_refactor_reference(B, A)
    assert not torch.isnan(ref_A).any() and torch.equal(ref_B, torch.zeros_like(ref_B))


def test_rank_deficient_b():
    B, A = _pair(2, 40, 6, 30)
    B[..., 3:] = 0
    B[..., 2] = B[..., 0] - 2 * B[..., 1]  # rank 2
    B_new, A_new = svd_refactor(B, A)
    s = _singular_values(B_new)
    truth = torch.linalg.svdvals(B @ A)[..., :6]
    torch.testing.assert_close(s[..., :2], truth[..., :2], rtol=1e-10, atol=0)
    assert float(s[..., 2:].amax()) < 1e-12 * float(s.amax())
    assert _ortho_error(A_new) < 1e-13
    assert _max_rel(B_new @ A_new, B @ A) < 1e-13
    assert not torch.isnan(B_new).any()


def test_repeated_singular_values():
    L, m, r, n = 2, 30, 6, 25
    U, _ = torch.linalg.qr(torch.randn(L, m, r, dtype=torch.float64))
    V = _orthonormal_rows(L, r, n)
    s = torch.tensor([3.0, 3.0, 2.0, 2.0, 2.0, 1.0], dtype=torch.float64)
    G = torch.randn(L, r, r, dtype=torch.float64) + 3 * torch.eye(r, dtype=torch.float64)
    A = G @ V  # not orthonormal, so the general path runs
    B = (U * s) @ torch.linalg.inv(G)  # B A = U diag(s) V
    B_new, A_new = svd_refactor(B, A)
    torch.testing.assert_close(_singular_values(B_new), s.expand(L, r), rtol=1e-10, atol=0)
    assert _ortho_error(A_new) < 1e-13
    assert _max_rel(B_new @ A_new, B @ A) < 1e-13
    _, ref_A = svd_refactor_reference(B, A)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):  # singular subspaces agree
        ours, theirs = A_new[:, rows], ref_A[:, rows]
        torch.testing.assert_close(ours.mT @ ours, theirs.mT @ theirs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtype_device_and_shape_preserved(dtype):
    B, A = _pair(3, 24, 4, 20, dtype)
    B_new, A_new = svd_refactor(B, A)
    assert (B_new.dtype, A_new.dtype) == (dtype, dtype)
    assert (B_new.device, A_new.device) == (B.device, A.device)
    assert B_new.shape == B.shape and A_new.shape == A.shape
    assert not torch.isnan(B_new.float()).any() and not torch.isnan(A_new.float()).any()
    compute = torch.float64 if dtype == torch.float64 else torch.float32  # half inputs run in float32
    up_B, up_A = svd_refactor(B.to(compute), A.to(compute))
    tol = 10 * torch.finfo(dtype).eps
    assert _max_rel(B_new, up_B.to(dtype)) < tol and _max_rel(A_new, up_A.to(dtype)) < tol


def test_rank_above_m_pads_b_and_rank_above_n_raises():
    B, A = _pair(2, 3, 5, 10)
    B_new, A_new = svd_refactor(B, A)
    assert _max_rel(B_new @ A_new, B @ A) < 1e-13
    assert _ortho_error(A_new) < 1e-13
    assert torch.equal(B_new[..., 3:], torch.zeros(2, 3, 2, dtype=torch.float64))
    ref_B, ref_A = svd_refactor_reference(B, A)
    torch.testing.assert_close(ref_A[:, :3], A_new[:, :3])  # rows 3, 4 span the null space
    torch.testing.assert_close(ref_B, B_new)
    with pytest.raises(ValueError, match="exceeds n"):
        svd_refactor(torch.randn(6, 5), torch.randn(5, 4))


def test_input_validation():
    with pytest.raises(ValueError, match="do not chain"):
        svd_refactor(torch.randn(2, 8, 4), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="batched alike"):
        svd_refactor(torch.randn(2, 8, 4), torch.randn(4, 8))
    with pytest.raises(ValueError, match="dtype and device"):
        svd_refactor(torch.randn(8, 4), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="unsupported dtype"):
        svd_refactor(torch.ones(8, 4, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64))


def test_accelerator_paths_do_not_branch_on_values(monkeypatch):
    A = torch.empty(2, 4, 16, device="meta")  # reading a meta tensor's values would raise
    assert sr._resolve_shortcut(A, None) is False
    assert sr._resolve_shortcut(A, True) is True
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert sr._svd_driver(torch.device("cuda"), 8) == "gesvdj"
    assert sr._svd_driver(torch.device("cuda"), 64) is None
    assert sr._svd_driver(torch.device("cpu"), 8) is None
    assert sr._COMPILED_FINALIZE.select(torch.device("cpu")) is sr._finalize
    assert sr._CompiledFinalize().select(torch.device("cuda")) is not sr._finalize


def test_compiled_finalize_falls_back_to_eager(monkeypatch):
    def broken_compile(fn, **_):
        def run(*args):
            raise RuntimeError("no triton")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    fused = sr._CompiledFinalize()
    B, A = _pair(2, 12, 3, 10)
    Qb, Rb = torch.linalg.qr(B)
    Uc, S, Vhc = torch.linalg.svd(Rb)
    args = (Qb, Uc, S, Vhc, A)
    with pytest.warns(UserWarning, match="eager"):
        out = fused.select(torch.device("cuda"))(*args)
    assert fused.select(torch.device("cuda")) is sr._finalize
    for x, y in zip(out, sr._finalize(*args), strict=True):
        assert torch.equal(x, y)


def _lora_state_dict() -> OrderedDict:
    g = torch.Generator().manual_seed(7)
    sd: OrderedDict = OrderedDict()
    sd["embeddings.weight"] = torch.randn(10, 4, generator=g)
    layers = {f"l{i}.query": (32, 4, 24) for i in range(3)}
    layers |= {f"l{i}.value": (40, 4, 24) for i in range(2)}
    layers["l0.dense"] = (32, 2, 24)
    for name, (m, r, n) in layers.items():
        sd[f"{name}.base_layer.weight"] = torch.randn(m, n, generator=g)
        sd[f"{name}.lora_A.weight"] = torch.randn(r, n, generator=g) / n**0.5
        sd[f"{name}.lora_B.weight"] = torch.randn(m, r, generator=g)
    sd["l9.query.lora_A.weight"] = torch.randn(4, 24, generator=g, dtype=torch.float64)
    sd["l9.query.lora_B.weight"] = torch.randn(32, 4, generator=g, dtype=torch.float64)
    sd["classifier.bias"] = torch.zeros(3)
    return sd


def test_state_dict_helper_groups_and_preserves_other_keys(monkeypatch):
    sd = _lora_state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    calls: list[tuple[int, ...]] = []
    kernel = sr.svd_refactor

    def spy(B, A, **kwargs):
        calls.append(tuple(B.shape))
        return kernel(B, A, **kwargs)

    monkeypatch.setattr(sr, "svd_refactor", spy)
    out = refactor_lora_state_dict(sd)
    assert sorted(calls) == sorted([(3, 32, 4), (2, 40, 4), (1, 32, 2), (1, 32, 4)])
    assert type(out) is OrderedDict and list(out) == list(sd)
    for key, value in sd.items():
        assert torch.equal(value, before[key])  # input not modified
        if "lora_" not in key:
            assert out[key] is value
    for prefix in ("l0.query", "l1.value", "l0.dense", "l9.query"):
        a_key, b_key = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
        B_new, A_new = kernel(sd[b_key], sd[a_key])
        torch.testing.assert_close(out[b_key], B_new)
        torch.testing.assert_close(out[a_key], A_new)
        assert out[a_key].dtype == sd[a_key].dtype


def test_state_dict_helper_custom_suffixes():
    sd = {
        "q.lora_A.default.weight": torch.randn(2, 6),
        "q.lora_B.default.weight": torch.randn(5, 2),
    }
    out = refactor_lora_state_dict(sd, a_suffix="lora_A.default.weight", b_suffix="lora_B.default.weight")
    torch.testing.assert_close(out["q.lora_B.default.weight"] @ out["q.lora_A.default.weight"],
                               sd["q.lora_B.default.weight"] @ sd["q.lora_A.default.weight"])
    assert _ortho_error(out["q.lora_A.default.weight"]) < 1e-6


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"x.lora_A.weight": torch.randn(2, 6)}, "no matching B"),
        ({"x.lora_B.weight": torch.randn(5, 2)}, "no matching A"),
        ({"x.lora_A.weight": torch.randn(2, 6), "x.lora_B.weight": torch.randn(5, 3)}, "shapes disagree"),
        ({"x.lora_A.weight": torch.randn(2, 6), "x.lora_B.weight": torch.randn(5, 2).double()}, "mixes"),
    ],
)
def test_state_dict_helper_errors(entries, message):
    with pytest.raises(ValueError, match=message):
        refactor_lora_state_dict({"other": torch.zeros(1), **entries})
