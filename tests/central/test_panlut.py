"""Pan-LUT: n-linear LUT lookups, identity init, rotations, Wald data, baselines' identities, runner."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsim.central_runner import method_params, run_central
from central.image import downsample, sam
from central.image.degrade import default_sigma
from central.panlut.baselines import PNN, brovey, gram_schmidt, pnn_params
from central.panlut.data import PAN_WEIGHTS, RATIO, scene, texture, training_crops
from central.panlut.lut import (curvature, identity_tables, interpolate, interpolate_lerp, interpolate_reference)
from central.panlut.model import BANDS, CHANNELS, ROTATIONS, PanLUT, panlut_ops_per_pixel, panlut_params, sd_stage
from fedsim import config as C
from fedsim.errors import ConfigError

# -- the LUT lookup --------------------------------------------------------------------------------


@pytest.mark.parametrize("lookup", [interpolate, interpolate_lerp], ids=["fused", "reference"])
@pytest.mark.parametrize("n_in,groups,outputs,dim", [(4, 3, 1, 4), (5, 1, 3, 3), (5, 2, 2, 4)])
def test_interpolation_equals_the_direct_vertex_loop(lookup, n_in, groups, outputs, dim) -> None:
    gen = torch.Generator().manual_seed(n_in * 10 + dim)
    tables = torch.rand(groups, outputs, *[dim] * n_in, generator=gen, dtype=torch.float64)
    pts = torch.rand(groups, 12, n_in, generator=gen, dtype=torch.float64)
    pts[:, 0] = 0.0                       # the first vertex
    pts[:, 1] = 1.0                       # the last vertex (bin clamped to dim − 2, frac 1)
    pts[:, 2] = torch.tensor([-0.05, 1.04, 0.5, 1 / (dim - 1), 0.3])[:n_in]  # outside: extrapolated
    out = lookup(tables, [pts[..., k] for k in range(n_in)])
    assert out.shape == (groups, 12, outputs)
    for g in range(groups):
        for i in range(12):
            ref = interpolate_reference(tables[g], pts[g, i].tolist())
            assert torch.allclose(out[g, i], ref, atol=1e-12), (g, i)


def test_interpolation_hits_table_entries_at_vertices_and_chunks_consistently(monkeypatch) -> None:
    import central.panlut.lut as L

    tables = torch.rand(1, 2, 5, 5, 5, 5, dtype=torch.float64)
    idx = torch.tensor([[0, 1, 4, 2], [3, 3, 0, 4]])
    coords = [(idx[:, k].double() / 4).unsqueeze(0) for k in range(4)]
    out = interpolate(tables, coords)[0]
    for j, (a, b, c, d) in enumerate(idx.tolist()):
        assert torch.allclose(out[j], tables[0, :, a, b, c, d])
    x = [torch.rand(2, 50, dtype=torch.float64) for _ in range(4)]
    whole = interpolate(torch.rand(2, 1, 3, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), x)
    monkeypatch.setattr(L, "CHUNK", 7)
    monkeypatch.setattr(L, "FUSED_CHUNK", 7)
    tables = torch.rand(2, 1, 3, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(whole, interpolate(tables, x)) and torch.equal(whole, interpolate_lerp(tables, x))


# Every LUT kind the model uses, at the model's dims and at odd ones: (G, C_out, n, d).
LUT_KINDS = {"PGLUT": (1, BANDS, CHANNELS, 9), "SDLUT": (CHANNELS, 1, 4, 9), "AOLUT": (1, BANDS, CHANNELS, 9),
             "PGLUT d3": (1, BANDS, CHANNELS, 3), "SDLUT d17": (CHANNELS, 1, 4, 17), "AOLUT d6": (1, BANDS, CHANNELS, 6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", list(LUT_KINDS))
def test_fused_lookup_equals_the_reference_exactly(kind, dtype) -> None:
    """The fused gather (one index_select of all corners × tables × outputs per chunk) performs the
    reference's lerps in the same order: bit-identical on random tables and inputs, outside [0, 1]
    and across chunk boundaries included; gradients agree too."""
    import central.panlut.lut as L

    g, c_out, n, dim = LUT_KINDS[kind]
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    npx = 2 * L.FUSED_CHUNK + 123                       # not a multiple of either chunk size
    tables = torch.randn(g, c_out, *[dim] * n, generator=gen, dtype=dtype)
    coords = [torch.rand(g, npx, generator=gen, dtype=dtype) * 1.2 - 0.1 for _ in range(n)]
    for c in coords:                                    # exact vertices and the border
        c[:, :dim] = torch.arange(dim, dtype=dtype) / (dim - 1)
    fused, ref = interpolate(tables, coords), interpolate_lerp(tables, coords)
    assert fused.shape == ref.shape == (g, npx, c_out) and fused.dtype == dtype
    assert torch.equal(fused, ref)
    t1, t2 = tables.clone().requires_grad_(), tables.clone().requires_grad_()
    x1 = [c[:, :300].clone().requires_grad_() for c in coords]
    x2 = [c[:, :300].clone().requires_grad_() for c in coords]
    w = torch.randn(g, 300, c_out, generator=gen, dtype=dtype)
    (interpolate(t1, x1) * w).sum().backward()
    (interpolate_lerp(t2, x2) * w).sum().backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(t1.grad, t2.grad, atol=tol)
    assert all(torch.allclose(a.grad, b.grad, atol=tol) for a, b in zip(x1, x2))


def test_fused_panlut_forward_equals_the_reference_forward() -> None:
    gen = torch.Generator().manual_seed(3)
    fused = PanLUT(9, 9, 9)
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ref = PanLUT(9, 9, 9, lookup=interpolate_lerp)
    ref.load_state_dict(fused.state_dict())
    ms, pan = torch.rand(2, BANDS, 37, 29, generator=gen), torch.rand(2, 1, 37, 29, generator=gen)
    with torch.inference_mode():
        assert torch.equal(fused(ms, pan), ref(ms, pan))
    assert len(ROTATIONS) == 4 and panlut_ops_per_pixel() == 1300


def test_gradients_reach_tables_and_coordinates() -> None:
    gen = torch.Generator().manual_seed(0)
    tables = torch.rand(1, 2, 3, 3, 3, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    coords = [(0.05 + 0.9 * torch.rand(1, 6, generator=gen, dtype=torch.float64)).requires_grad_() for _ in range(5)]
    assert torch.autograd.gradcheck(lambda t, *c: interpolate(t, c), (tables, *coords))


def test_identity_tables_reproduce_their_inputs() -> None:
    x = [torch.rand(1, 200) for _ in range(5)]
    out = interpolate(identity_tables(1, 5, 9, [0, 1, 2, 3]), x)[0]
    assert torch.allclose(out, torch.stack(x[:4], dim=-1)[0], atol=1e-6)
    for dim in (2, 3, 9):
        assert float(curvature(identity_tables(2, 4, dim, [2]))) == pytest.approx(0.0, abs=1e-12)


def test_identity_initialised_panlut_returns_the_upsampled_ms() -> None:
    ms, pan = torch.rand(2, 4, 12, 10), torch.rand(2, 1, 12, 10)
    assert torch.allclose(PanLUT(3, 5, 4)(ms, pan), ms, atol=1e-6)


def test_rotated_sd_stages_take_the_four_neighbours_exactly() -> None:
    x = torch.rand(1, 5, 9, 11)
    right = identity_tables(5, 4, 5, [1])              # output = the right neighbour of the rotated image
    out = [sd_stage(right, x, k) for k in range(4)]
    i, j = slice(1, -1), slice(1, -1)
    assert torch.allclose(out[0][..., i, j], x[..., 1:-1, 2:], atol=1e-6)    # 0°: right
    assert torch.allclose(out[1][..., i, j], x[..., 2:, 1:-1], atol=1e-6)    # 90°: below
    assert torch.allclose(out[2][..., i, j], x[..., 1:-1, :-2], atol=1e-6)   # 180°: left
    assert torch.allclose(out[3][..., i, j], x[..., :-2, 1:-1], atol=1e-6)   # 270°: above
    z = x
    for k in range(4):                                  # right, below, left, above: back to the start
        z = sd_stage(right, z, k)
    assert torch.allclose(z[..., 2:-2, 2:-2], x[..., 2:-2, 2:-2], atol=1e-6)


def test_sd_stage_clamps_to_unit_range() -> None:
    tables = identity_tables(1, 4, 3, [0]) * 3 - 1      # maps [0, 1] to [−1, 2]
    out = sd_stage(tables, torch.rand(1, 1, 6, 6), 1)
    assert out.min() >= 0 and out.max() <= 1 and (out == 0).any() and (out == 1).any()


def test_parameter_counts() -> None:
    for dims in [(9, 9, 9), (3, 17, 6)]:
        model = PanLUT(*dims)
        n = sum(p.numel() for p in model.parameters())
        assert n == panlut_params(*dims) == 4 * dims[0] ** 5 + 4 * 5 * dims[1] ** 4 + 4 * dims[2] ** 5
    assert panlut_params(9, 9, 9) == 603_612 < 700_000
    assert sum(p.numel() for p in PNN().parameters()) == pnn_params() == 80_420


def test_lut_training_reduces_the_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    ms, pan = torch.rand(4, 4, 16, 16, generator=gen), torch.rand(4, 1, 16, 16, generator=gen)
    target = (0.7 * ms + 0.3 * pan).clamp(0, 1)
    model = PanLUT(3, 3, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = (model(ms, pan) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


# -- Wald-protocol data ----------------------------------------------------------------------------


def test_wald_scene_is_as_specified() -> None:
    s = scene("chelsea", 70)
    h, w = s.ref.shape[:2]
    assert (h, w) == (68, 68) and s.ref.shape[2] == 4 and s.ref.dtype == np.float32
    assert s.ms_lr.shape == (h // RATIO, w // RATIO, 4) and s.ms_up.shape == (h, w, 4) and s.pan.shape == (h, w, 1)
    assert np.allclose(s.ms_lr, downsample(s.ref, RATIO), atol=1e-7)
    assert math.isclose(default_sigma(RATIO), 4 * math.sqrt(-2 * math.log(0.3)) / math.pi)
    assert np.allclose(s.pan[..., 0], np.tensordot(s.ref, np.array(PAN_WEIGHTS), axes=([2], [0])), atol=1e-6)
    assert math.isclose(sum(PAN_WEIGHTS), 1.0)
    assert 0 <= s.ref.min() and s.ref.max() <= 1 and 0 <= s.ms_up.min() and s.ms_up.max() <= 1
    rgb = s.ref[..., :3]
    assert np.array_equal(texture("chelsea", (8, 8)), texture("chelsea", (8, 8)))
    assert not np.allclose(s.ref[..., 3], rgb.mean(axis=2))          # NIR is not a copy of the RGB mean


def test_training_crops_are_aligned() -> None:
    ms, pan, ref = training_crops(["coffee"], 16, 3, 64, np.random.default_rng(0))
    s = scene("coffee", 64)
    assert ms.shape == (3, 4, 16, 16) and pan.shape == (3, 1, 16, 16) and ref.shape == (3, 4, 16, 16)
    assert np.allclose(pan[:, 0], np.einsum("nchw,c->nhw", ref, np.array(PAN_WEIGHTS, np.float32)), atol=1e-6)
    found = [(y, x) for y in range(64 - 15) for x in range(64 - 15) if np.array_equal(s.ref[y:y + 16, x:x + 16], ref[0].transpose(1, 2, 0))]
    assert found and np.array_equal(s.ms_up[found[0][0]:found[0][0] + 16, found[0][1]:found[0][1] + 16], ms[0].transpose(1, 2, 0))


# -- baselines -------------------------------------------------------------------------------------


def test_brovey_keeps_band_ratios_and_sets_the_band_mean_to_pan() -> None:
    gen = torch.Generator().manual_seed(0)
    ms, pan = 0.1 + 0.8 * torch.rand(1, 4, 8, 8, generator=gen), torch.rand(1, 1, 8, 8, generator=gen)
    out = brovey(ms, pan)
    assert torch.allclose(out.mean(dim=1, keepdim=True), pan, atol=1e-5)
    assert torch.allclose(out[:, 0] / out[:, 2], ms[:, 0] / ms[:, 2], rtol=1e-5)
    assert sam(ms[0].permute(1, 2, 0).numpy(), out[0].permute(1, 2, 0).numpy()) < 1e-2


def test_gram_schmidt_identities() -> None:
    gen = torch.Generator().manual_seed(1)
    ms, pan = torch.rand(2, 4, 10, 10, generator=gen), torch.rand(2, 1, 10, 10, generator=gen)
    out = gram_schmidt(ms, pan)
    intensity = ms.mean(dim=1, keepdim=True)
    d = (1, 2, 3)
    matched = (pan - pan.mean(d, True)) * intensity.std(d, keepdim=True) / pan.std(d, keepdim=True) + intensity.mean(d, True)
    assert torch.allclose(out.mean(dim=1, keepdim=True), matched, atol=1e-4)   # mean_b g_b = 1
    detail = out - ms                                                           # g_b · (P' − I), rank one per image
    ratio = detail[:, 1] / detail[:, 0]
    assert torch.allclose(ratio, ratio.flatten(1)[:, :1, None].expand_as(ratio), rtol=1e-3)
    assert torch.allclose(gram_schmidt(ms, intensity), ms, atol=1e-5)          # PAN = I: nothing to inject


# -- the runner ------------------------------------------------------------------------------------

TINY = ["params.methods=[panlut,pnn,gs,brovey]", "params.test_images=[chelsea]", "params.train_images=[coffee]",
        "params.max_side=64", "params.crop=32", "params.crops_per_image=4", "params.batch=2", "params.steps=3",
        "params.pg_dim=3", "params.sd_dim=3", "params.ao_dim=3", "params.throughput_image=none",
        "params.grid_crop=32", "params.log_every=1"]
TIMING = ("mpix_per_s/", "mpix_ratio/", "eval/mpix_per_s", "claim/speedup")


def _run(overrides: list[str], seed: int = 0):
    cfg = C.load_central_config("panlut", TINY + overrides, seed)
    cfg.tracking.enabled = False
    return run_central(cfg)


def test_same_seed_same_metrics_and_untrained_models_equal_bicubic() -> None:
    a, b = _run([]), _run([])
    quality = {k: v for k, v in a.metrics.items() if not k.startswith(TIMING)}
    assert quality == {k: v for k, v in b.metrics.items() if not k.startswith(TIMING)}
    assert {"psnr/panlut", "sam/pnn", "ergas/gs", "psnr/brovey", "claim/psnr_gap_db", "eval/psnr"} <= set(a.metrics)
    assert a.metrics["params/panlut"] == panlut_params(3, 3, 3)
    assert not any(k.endswith("params_below_700k") for k in a.metrics)   # no 0/1 claim flags
    assert a.metrics["claim/ops_ratio"] == a.metrics["ops_per_px/pnn"] / a.metrics["ops_per_px/panlut"]
    assert {"per_image", "claim", "training_curves"} <= set(a.tables)
    c = _run([], seed=1)
    assert c.metrics["psnr/pnn"] != a.metrics["psnr/pnn"]
    z = _run(["params.steps=0", "params.methods=[panlut,pnn]"])
    for m in ("panlut", "pnn"):                     # identity LUTs / zero residual: the bicubic output
        assert z.metrics[f"psnr/{m}"] == pytest.approx(z.metrics["psnr/bicubic"], abs=1e-4)


@pytest.mark.parametrize("override,match", [
    ("params.methods=[panlut,srcnn]", "methods"),
    ("params.test_images=[lena]", "unknown images"),
    ("params.train_images=[chelsea]", "overlap"),
    ("params.pg_dim=1", "pg_dim"),
    ("params.crop=30", "crop"),
    ("params.steps=-1", "steps"),
    ("params.lr_lut=0", "lr_lut"),
    ("params.smooth=-1", "smooth"),
    ("params.throughput_image=moon", "throughput_image"),
    ("params.timing_repeats=0", "timing_repeats"),
])
def test_bad_params_give_one_line_config_errors(override, match) -> None:
    cfg = C.load_central_config("panlut", TINY + [override], 0)
    cfg.tracking.enabled = False
    with pytest.raises(ConfigError, match=match) as err:
        run_central(cfg)
    assert "\n" not in str(err.value)


def test_default_experiment_params_are_valid() -> None:
    p = method_params(C.load_central_config("panlut"))
    from central.panlut.run import check

    check(p)
    assert panlut_params(p.pg_dim, p.sd_dim, p.ao_dim) < 700_000


def test_throughput_is_timed_alike_for_every_method_and_logged_with_its_size_ratio() -> None:
    r = _run(["params.methods=[panlut,pnn,brovey]", "params.test_images=[chelsea,coffee]",
              "params.train_images=[astronaut]", "params.throughput_image=coffee", "params.timing_repeats=2"])
    for m in ("panlut", "pnn", "brovey"):
        assert r.metrics[f"mpix_per_s/{m}"] > 0 and r.metrics[f"mpix_ratio/{m}"] > 0
    assert r.metrics["claim/speedup"] == pytest.approx(r.metrics["mpix_per_s/panlut"] / r.metrics["mpix_per_s/pnn"])
    assert all(row["repeats"] == 2 for row in r.tables["per_image"])


def test_claim_spec_is_valid_and_every_child_is_read_by_a_verdict() -> None:
    from central.panlut.run import check
    from tests.central.claim_spec import checked_claim_spec

    spec, grid = checked_claim_spec("panlut", check)
    assert spec.metric == "eval/psnr" and len(spec.seeds) >= 3 and spec.has_protocol
    by_metric = {c.metrics(spec.metric): c for c in spec.claim}
    quality = by_metric[("psnr/panlut", "psnr/pnn")]              # non-inferiority within 1 dB
    assert quality.margin == -1.0 and quality.kind == "superiority" and quality.higher_is_better
    assert ("mpix_per_s/panlut", "mpix_per_s/pnn") in by_metric
    params = by_metric[("params/panlut",)]
    assert params.worse_value == 700_000 and not params.higher_is_better
    assert by_metric[("claim/ops_ratio",)].worse_value > 1 and by_metric[("claim/speedup",)].worse_value >= 1
    assert not any("below_700k" in m for c in [*spec.claim, *spec.controls.positive] for m in c.metrics(spec.metric))
    assert spec.controls.positive and spec.controls.floor.value is not None and spec.controls.floor.source
    assert spec.minutes_per_run and "noisy" in spec.description.lower()
