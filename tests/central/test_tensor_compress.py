"""Distribution-aware tensor compression: Σ, the Σ-weighted ALS, baselines, factorised convs, ratios, runner."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsim.central_runner import method_params, run_central
from central.tensor_compress import als
from central.tensor_compress import ratio as R
from central.tensor_compress import run as RUN
from central.tensor_compress.als import (DT, ModeProblem, cp_als_sigma, sigma_error, to_matrix, tucker2_als_sigma)
from central.tensor_compress.baselines import cp_frobenius, tucker2_frobenius
from central.tensor_compress.model import CPConv, Tucker2Conv, weight_params
from central.tensor_compress.sigma import estimate_sigmas, floor_psd, patch_second_moment
from fedsim import config as C
from fedsim.errors import ConfigError


def _kernel(c_out: int = 6, c_in: int = 5, k: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(c_out, c_in, k, k, generator=g, dtype=DT)


def _sigma(n: int, seed: int = 1, floor: float = 1e-6) -> torch.Tensor:
    """An anisotropic, ill-conditioned second moment (strongly correlated patch coordinates)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, n // 2, generator=g, dtype=DT) @ torch.randn(n // 2, n, generator=g, dtype=DT)
    x = x * torch.logspace(0, -2, n, dtype=DT)
    return floor_psd(x.T @ x / 400, floor)[0]


# -- Σ ---------------------------------------------------------------------------------------------

def test_sigma_of_a_tiny_input_equals_a_direct_patch_loop() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 5, 4, generator=g, dtype=DT)
    for stride, padding in ((1, 1), (2, 1), (1, 0)):
        conv = nn.Conv2d(2, 3, 3, stride, padding, bias=False)
        xp = F.pad(x, (padding,) * 4)
        rows = [xp[b, :, i:i + 3, j:j + 3].reshape(-1)
                for b in range(2)
                for i in range(0, xp.shape[2] - 2, stride)
                for j in range(0, xp.shape[3] - 2, stride)]
        direct = sum(torch.outer(r, r) for r in rows) / len(rows)
        assert torch.allclose(patch_second_moment(x, conv), direct, atol=1e-12)


def test_sigma_hooks_see_the_original_layer_inputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, stride=2, padding=1))
    x = torch.randn(7, 1, 6, 6)
    with torch.no_grad():
        hidden = F.relu(model[0](x))
    sig = estimate_sigmas(model, ["2"], [x[:4], x[4:]])["2"]
    assert torch.allclose(sig, patch_second_moment(hidden, model[2]), atol=1e-6)
    sig_f, s = floor_psd(sig, 1e-2)
    lam = torch.linalg.eigvalsh(sig_f)
    assert torch.allclose(s @ s, sig_f, atol=1e-9) and torch.allclose(s, s.T)
    assert float(lam.min()) >= 1e-2 * float(lam.max()) * (1 - 1e-9)
    assert float(torch.linalg.eigvalsh(sig).min()) < 1e-2 * float(lam.max())  # the floor did something


# -- the Σ-weighted ALS ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["tucker", "cp"])
def test_sigma_als_never_increases_its_objective(family) -> None:
    w = _kernel()
    sig = _sigma(w.shape[1] * 9)
    run = (lambda **kw: tucker2_als_sigma(w, 3, 3, sig, n_iter_max=30, tol=0, **kw)) if family == "tucker" else \
          (lambda **kw: cp_als_sigma(w, 7, sig, n_iter_max=30, tol=0, **kw))
    t, trace = run()
    assert trace.sweeps >= 5
    assert all(b <= a for a, b in zip(trace.errors, trace.errors[1:]))
    assert trace.errors[-1] < 0.9 * trace.errors[0]
    assert sigma_error(to_matrix(w), t.matrix(), sig) == pytest.approx(trace.errors[-1], rel=1e-12)
    # every block update is an exact least-squares step, so even without the revert rule it cannot go up
    _, raw = run(revert=False)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(raw.errors, raw.errors[1:]))


def test_the_revert_rule_restores_the_previous_iterate(monkeypatch) -> None:
    w, sig = _kernel(), _sigma(45)
    calls = {"n": 0}
    honest = als._update_u_out

    def worse_on_the_fourth_sweep(pb, t):
        calls["n"] += 1
        u = honest(pb, t)
        return 5.0 * u + 1.0 if calls["n"] == 4 else u

    monkeypatch.setattr(als, "_update_u_out", worse_on_the_fourth_sweep)
    t, trace = tucker2_als_sigma(w, 3, 3, sig, n_iter_max=30, tol=0)
    assert trace.reverted and trace.sweeps == 3 and calls["n"] == 4
    assert sigma_error(to_matrix(w), t.matrix(), sig) == pytest.approx(trace.errors[-1], rel=1e-12)


def test_identity_sigma_equals_plain_tucker2_and_parafac() -> None:
    w = _kernel(7, 6)
    t_ours, tr_ours = tucker2_als_sigma(w, 3, 4, None, n_iter_max=500, tol=1e-13)
    t_tl, _ = tucker2_frobenius(w, 3, 4, n_iter_max=500, tol=1e-13)
    eye = torch.eye(54, dtype=DT)
    e_ours, e_tl = sigma_error(to_matrix(w), t_ours.matrix(), eye), sigma_error(to_matrix(w), t_tl.matrix(), eye)
    assert e_ours == pytest.approx(e_tl, abs=1e-7) and 0.2 < e_ours < 0.95
    assert tr_ours.errors[-1] == pytest.approx(e_ours, rel=1e-12)
    # same init (tensorly's SVD) and mode order: our CP-ALS with Σ = I follows parafac
    c_ours, _ = cp_als_sigma(w, 5, None, n_iter_max=40, tol=0, seed=3)
    c_tl, _ = cp_frobenius(w, 5, n_iter_max=40, tol=0, seed=3)
    assert torch.allclose(c_ours.matrix(), c_tl.matrix(), atol=1e-6)


def test_sigma_als_beats_the_frobenius_fit_in_the_sigma_norm_and_cg_agrees_with_dense() -> None:
    w = _kernel(8, 6)
    sig = _sigma(54)
    t_fro, _ = tucker2_frobenius(w, 3, 3)
    t_sig, _ = tucker2_als_sigma(w, 3, 3, sig, n_iter_max=60)
    t_cg, _ = tucker2_als_sigma(w, 3, 3, sig, n_iter_max=60, dense_max=0, cg_max_iter=2000)
    e = {name: sigma_error(to_matrix(w), t.matrix(), sig) for name, t in (("fro", t_fro), ("sig", t_sig), ("cg", t_cg))}
    assert e["sig"] < 0.8 * e["fro"]
    assert e["cg"] == pytest.approx(e["sig"], rel=1e-4)
    # the matrix-free operator is the dense normal matrix
    g = torch.Generator().manual_seed(5)
    mp = ModeProblem(sig, sig @ to_matrix(w), torch.randn(3, 9, 8, generator=g, dtype=DT))
    x = torch.randn(6, 3, generator=g, dtype=DT)
    assert torch.allclose(mp.dense() @ x.reshape(-1), mp.matvec(x).reshape(-1), atol=1e-9)
    assert torch.allclose(torch.diagonal(mp.dense()).reshape(6, 3), mp.diagonal(), atol=1e-9)


# -- factorised convs and ratios ---------------------------------------------------------------------

@pytest.mark.parametrize("stride,bias", [(1, False), (2, True)])
def test_factorised_convs_equal_the_reconstructed_kernel(stride, bias) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 10, 3, stride, 1, bias=bias).double()
    x = torch.randn(2, 6, 9, 8, dtype=DT)
    t, _ = tucker2_als_sigma(conv.weight, 3, 4, None, n_iter_max=3)
    c, _ = cp_als_sigma(conv.weight, 5, None, n_iter_max=3)
    for module, fact in ((Tucker2Conv(conv, t), t), (CPConv(conv, c), c)):
        ref = F.conv2d(x, fact.kernel((3, 3)), conv.bias, stride, 1)
        assert torch.allclose(module(x), ref, atol=1e-10)
        assert not torch.allclose(ref, conv(x), atol=1e-3)  # a genuine approximation, not the original
    assert weight_params(Tucker2Conv(conv, t)) == R.tucker2_params(6, 10, 9, 3, 4) == 6 * 3 + 3 * 4 * 9 + 4 * 10
    assert weight_params(CPConv(conv, c)) == R.cp_params(6, 10, 9, 5) == 5 * (6 + 9 + 10)


def test_ranks_meet_the_compression_ratio() -> None:
    for c_in, c_out in ((8, 8), (8, 16), (16, 32), (32, 32), (5, 64)):
        orig = R.conv_params(c_in, c_out, 9)
        last_t, last_c = None, None
        for ratio in (1.25, 1.5, 2, 3, 4, 8):
            r_in, r_out = R.tucker2_ranks(c_in, c_out, 9, ratio)
            rank = R.cp_rank(c_in, c_out, 9, ratio)
            p_t, p_c = R.tucker2_params(c_in, c_out, 9, r_in, r_out), R.cp_params(c_in, c_out, 9, rank)
            assert 1 <= r_in <= c_in and 1 <= r_out <= c_out and rank >= 1
            if (r_in, r_out) != (1, 1):
                assert orig / p_t >= ratio
            if rank > 1:
                assert orig / p_c >= ratio and orig / R.cp_params(c_in, c_out, 9, rank + 1) < ratio  # the largest
            assert last_t is None or (p_t <= last_t and p_c <= last_c)
            last_t, last_c = p_t, p_c
    assert R.tucker2_ranks(32, 32, 9, 2) == (19, 19) and R.cp_rank(32, 32, 9, 2) == 63


# -- the registered method ---------------------------------------------------------------------------

TINY = ("method: tensor_compress\ndescription: tiny\nseed: 0\ntracking: {enabled: false}\nparams:\n"
        "  methods: [tucker_fro, tucker_id, tucker_sigma, cp_sigma_transfer]\n  ratios: [2.0]\n"
        "  width: 4\n  epochs: 1\n  n_train: 300\n  n_test: 100\n  sigma_images: 40\n  n_iter_max: 4\n")


def test_same_seed_gives_identical_metrics_through_the_runner(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tc.yaml"
    path.write_text(TINY)
    a = run_central(C.load_central_config(str(path)))
    b = run_central(C.load_central_config(str(path)))
    assert a.metrics == b.metrics
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(a.tables["accuracy"]) == strip(b.tables["accuracy"])
    assert list(tmp_path.joinpath("cache", "tensor_compress").glob("resnet-*.pt"))
    assert {"acc/original", "acc/tucker_sigma/x2", "eval/accuracy", "claim/tucker_sigma_gain"} <= set(a.metrics)
    assert a.metrics["eval/accuracy"] == a.metrics["acc/tucker_fro/x2"]
    layers = a.tables["layers"]
    assert len(layers) == 4 * 6 and all(r["params"] * 2 <= r["original_params"] for r in layers)
    by = {(r["method"], r["layer"]): r for r in layers}
    for name in {r["layer"] for r in layers}:  # each fit wins in its own norm
        assert by[("tucker_sigma", name)]["rel_sigma_err"] <= by[("tucker_fro", name)]["rel_sigma_err"] + 1e-9
        assert by[("tucker_id", name)]["rel_fro_err"] <= by[("tucker_sigma", name)]["rel_fro_err"] + 1e-9
    # the summary's fit errors (the claim spec's controls read them) are the layers' means
    for key in ("rel_fro_err", "rel_sigma_err"):
        for method in ("tucker_fro", "tucker_sigma"):
            mean = np.mean([r[key] for r in layers if r["method"] == method])
            assert a.metrics[f"fit/{key}/{method}"] == pytest.approx(mean, abs=1e-5)  # the table rounds to 5 places
        assert a.metrics[f"fit/{key}"] == a.metrics[f"fit/{key}/tucker_fro"]  # the first method's, as eval/accuracy
    c = run_central(C.load_central_config(str(path), seed=1))
    assert c.metrics != a.metrics


@pytest.mark.parametrize("override,message", [
    ("params.methods=[tucker_svd]", "params.methods"),
    ("params.methods=[]", "params.methods"),
    ("params.methods=[cp_fro,cp_fro]", "duplicates"),
    ("params.ratios=[1.0]", "ratios > 1"),
    ("params.ratios=[]", "ratios"),
    ("params.transfer_source=cifar", "transfer_source"),
    ("params.width=1", "width"),
    ("params.n_train=4500", "n_train"),
    ("params.sigma_images=5000", "sigma_images"),
    ("params.sigma_floor=0", "sigma_floor"),
    ("params.n_iter_max=0", "n_iter_max"),
    ("params.lr=-1", "params.lr"),
])
def test_bad_params_are_one_line_config_errors(override, message) -> None:
    cfg = C.load_central_config("tensor_compress", [override, "tracking.enabled=false"])
    with pytest.raises(ConfigError, match=message) as info:
        run_central(cfg)
    assert "\n" not in str(info.value)


def test_defaults_and_claim_spec_are_valid() -> None:
    from fedsim import reproduce

    RUN.check(method_params(C.load_central_config("tensor_compress")))
    spec = reproduce.load_claim("tensor_compress")
    seen = set()
    for setting in reproduce.settings(spec):
        params = method_params(reproduce.build_config(spec, setting, 0))
        RUN.check(params)
        seen.add((params.methods[0], params.ratios[0]))
    assert {m for m, _ in seen} >= {"tucker_fro", "tucker_sigma", "tucker_sigma_transfer", "cp_fro", "cp_sigma"}
    assert len(seen) == len(reproduce.settings(spec)) and len({r for _, r in seen}) >= 3
    assert spec.metric == "eval/accuracy" and len(spec.seeds) >= 3 and spec.has_protocol
    assert np.all([RUN.sigma_source(m) in (None, "target", "transfer") for m in RUN.METHODS])
