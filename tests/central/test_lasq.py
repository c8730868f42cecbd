"""LASQ: γ₀ formula, Metropolis bounds/acceptance/energy, luminance layers, DDPM schedule, the run."""

from __future__ import annotations

import math

import pytest
import torch

from fedsim.central_runner import run_central
from central.lasq.diffusion import (DiffusionConfig, LasqDiffusion, alpha_bars, antithetic_timesteps,
                                    level_of_timestep, linear_betas, q_sample, to_signed)
from central.lasq.gamma import (ChainTrace, GammaConfig, base_luminance, gamma_energy, initial_gamma,
                                mcmc_sample_gamma, metropolis_accept)
from central.lasq.layers import bilateral3, grid_size, level_regions, pool_gamma, wavelet_fuse
from central.lasq.run import LasqParams, check
from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError


def _dark(seed: int = 0, b: int = 1, size: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(1, 3, size, size, generator=g) * 0.25).repeat(b, 1, 1, 1)


# -- γ₀ and the Metropolis chain ---------------------------------------------------------------------

def test_initial_gamma_formula_on_known_luminance() -> None:
    L = torch.tensor([0.0, 0.25, 0.5, 1.0])
    expected = torch.tensor([1 / 3.5, 3.75 ** -0.5, 1.0, 4.5])
    assert torch.allclose(initial_gamma(L, 3.5), expected, atol=1e-6)
    assert torch.all(initial_gamma(torch.tensor([0.1, 0.3])) < 1)  # dark regions are brightened


def test_base_luminance_is_a_normalised_blur() -> None:
    const = torch.full((1, 3, 20, 30), 0.3)
    assert torch.allclose(base_luminance(const, (10.0, 25.0, 75.0, 125.0)), const, atol=1e-6)
    x = _dark(1, size=32)
    L = base_luminance(x, (10.0, 25.0))
    assert L.shape == x.shape and L.std() < x.std()  # smoothing


def test_energy_of_identity_gamma_is_the_exposure_gap() -> None:
    x = _dark(2)
    e = gamma_energy(torch.ones_like(x), x, GammaConfig())  # flat γ: no TV; x^1 = x: no structure term
    assert torch.allclose(e, (x.mean() - 0.55).abs().view(1), atol=1e-6)


def test_metropolis_acceptance_rule() -> None:
    T = 0.02
    u = torch.tensor([0.0, 0.3, 0.49, 0.51, 0.99])
    assert metropolis_accept(torch.full((5,), -0.1), T, u).all()  # downhill: always
    accepted = metropolis_accept(torch.full((5,), T * math.log(2.0)), T, u)  # uphill, prob 1/2
    assert accepted.tolist() == [True, True, True, False, False]
    g = torch.Generator().manual_seed(0)
    freq = metropolis_accept(torch.full((200_000,), 0.01), T, torch.rand(200_000, generator=g)).float().mean()
    assert abs(float(freq) - math.exp(-0.01 / T)) < 0.005


def test_sampled_gamma_respects_its_bounds() -> None:
    x = _dark(3, b=4)
    start = torch.linspace(0.0, 5.0, x.numel()).view_as(x)  # far outside [0.3, 3.5]
    cfg = GammaConfig(mcmc_steps=20, proposal_std=1.0, temperature=10.0)
    trace = ChainTrace()
    gamma = mcmc_sample_gamma(x, start, cfg, torch.Generator().manual_seed(0), trace)
    assert gamma.min() >= 0.3 and gamma.max() <= 3.5
    assert trace.acceptance_rate() > 0.5 and len(trace.energies) == 21
    none = mcmc_sample_gamma(x, start, GammaConfig(mcmc_steps=0), torch.Generator().manual_seed(0))
    assert none.min() >= 0.3 and none.max() <= 3.5


def _tiny() -> torch.Tensor:
    """A 2×2 one-channel image: few enough pixels that single proposals can lower the exposure term."""
    return torch.tensor([[[[0.05, 0.1], [0.15, 0.2]]]]).repeat(64, 1, 1, 1)


def _chain(x: torch.Tensor, start: torch.Tensor, temperature: float, steps: int, seed: int = 0) -> ChainTrace:
    trace = ChainTrace()
    mcmc_sample_gamma(x, start, GammaConfig(mcmc_steps=steps, temperature=temperature),
                      torch.Generator().manual_seed(seed), trace)
    return trace


def test_zero_temperature_chain_never_goes_uphill() -> None:
    x = _tiny()
    e = torch.stack(_chain(x, torch.ones_like(x), 1e-12, 50).energies)
    assert torch.all(e[1:] <= e[:-1] + 1e-7) and e[-1].mean() < e[0].mean() - 0.02


def test_metropolis_energy_decreases_on_average_when_the_filter_bites() -> None:
    """Tiny case, T = 1e-3 (ΔE/T of order 1): the mean energy falls and ends far below an accept-all walk
    driven by the same random numbers."""
    x = _tiny()
    metropolis, walk = _chain(x, torch.ones_like(x), 1e-3, 50), _chain(x, torch.ones_like(x), 1e9, 50)
    assert metropolis.energies[-1].mean() < metropolis.energies[0].mean() - 0.02
    assert metropolis.energies[-1].mean() < walk.energies[-1].mean() - 0.05


def test_authors_temperature_is_nearly_a_random_walk_but_never_worse() -> None:
    """At T = 0.02 and std 0.03 on a 16² image, almost every whole-map proposal is accepted (ΔE ≪ T); the
    filter still keeps the mean energy below the coupled accept-all walk's."""
    x = _dark(5, b=16)
    gamma0 = initial_gamma(base_luminance(x, (10.0,)))
    for seed in range(3):
        metropolis, walk = _chain(x, gamma0, 0.02, 16, seed), _chain(x, gamma0, 1e9, 16, seed)
        assert metropolis.acceptance_rate() > 0.8
        assert metropolis.energies[-1].mean() < walk.energies[-1].mean()


# -- luminance layers --------------------------------------------------------------------------------

def test_level_grid_sizes() -> None:
    """The authors' grid side is int(√(2^i)): 1, 1, 2, 2, 4, 5, 8, 11, 16, 22 (region counts non-decreasing)."""
    assert [grid_size(level_regions(i)) for i in range(10)] == [1, 1, 2, 2, 4, 5, 8, 11, 16, 22]


def test_pooling_shapes_and_monotone_refinement() -> None:
    g = torch.Generator().manual_seed(0)
    gamma = 0.3 + 3.2 * torch.rand(2, 3, 32, 32, generator=g)
    distinct, errors = [], {}
    for level in range(10):
        pooled = pool_gamma(gamma, level_regions(level))
        assert pooled.shape == gamma.shape
        side = 32 // (32 // grid_size(level_regions(level)))  # the authors' blocks are H // g pixels wide
        distinct.append(pooled[0, 0].unique().numel())
        assert distinct[-1] == side * side
        if 32 % side == 0:  # the blocks tile the image: block means keep the image mean
            assert torch.allclose(pooled.mean((2, 3)), gamma.mean((2, 3)), atol=1e-5)
            errors[level] = float((pooled - gamma).pow(2).mean())
    assert distinct == sorted(distinct)
    nested = [errors[k] for k in sorted(errors)]  # grids 1, 2, 4, 8, 16, 32: nested, so the error can only fall
    assert distinct == [1, 1, 4, 4, 16, 25, 64, 256, 256, 1024]
    assert list(errors) == [0, 1, 2, 3, 4, 6, 7, 8, 9] and all(b <= a + 1e-9 for a, b in zip(nested, nested[1:]))
    assert nested[-1] < nested[0]
    assert torch.equal(pool_gamma(gamma, 32 * 32), gamma)


def test_bilateral_keeps_constants_and_stays_within_the_neighbourhood() -> None:
    const = torch.full((1, 3, 8, 8), 0.4)
    assert torch.allclose(bilateral3(const), const, atol=1e-6)
    x = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = bilateral3(x)
    assert y.min() >= x.min() - 1e-6 and y.max() <= x.max() + 1e-6 and (y - x).abs().max() > 1e-3


def _haar(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a, b, c, d = x[..., ::2, ::2], x[..., ::2, 1::2], x[..., 1::2, ::2], x[..., 1::2, 1::2]
    return (a + b + c + d) / 2, (a - b + c - d) / 2, (a + b - c - d) / 2, (a - b - c + d) / 2


def _ihaar(ll: torch.Tensor, lh: torch.Tensor, hl: torch.Tensor, hh: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*ll.shape[:-2], 2 * ll.shape[-2], 2 * ll.shape[-1])
    out[..., ::2, ::2], out[..., ::2, 1::2] = (ll + lh + hl + hh) / 2, (ll - lh + hl - hh) / 2
    out[..., 1::2, ::2], out[..., 1::2, 1::2] = (ll + lh - hl - hh) / 2, (ll - lh - hl + hh) / 2
    return out


def test_wavelet_fusion_with_equal_band_weights_is_a_pixel_blend() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(1, 3, 8, 10, generator=g), torch.rand(1, 3, 8, 10, generator=g)
    assert torch.allclose(_ihaar(*_haar(a)), a, atol=1e-6)
    fused = _ihaar(*[0.64 * u + 0.36 * v for u, v in zip(_haar(a), _haar(b))])
    assert torch.allclose(wavelet_fuse(a, b), fused.clamp(0, 1), atol=1e-6)


# -- the diffusion model -----------------------------------------------------------------------------

def test_forward_noising_has_the_right_marginal_variance() -> None:
    cfg = DiffusionConfig(timesteps=100)
    abar = alpha_bars(linear_betas(cfg))
    assert torch.all(abar[1:] < abar[:-1]) and abar[-1] < 1e-3 and abar[0] > 0.99
    g = torch.Generator().manual_seed(0)
    x0 = 0.3 + 0.5 * torch.randn(20_000, 1, 1, 1, generator=g)  # mean 0.3, variance 0.25
    for t in (0, 20, 50, 99):
        xt = q_sample(x0, torch.full((20_000,), t), abar, torch.randn(x0.shape, generator=g))
        a = float(abar[t])
        assert abs(float(xt.var()) - (0.25 * a + 1 - a)) < 0.03
        assert abs(float(xt.mean()) - 0.3 * math.sqrt(a)) < 0.03


def test_timestep_selects_the_layer_level() -> None:
    t = torch.tensor([0, 9, 10, 55, 99])
    assert level_of_timestep(t, 100, 10).tolist() == [0, 0, 1, 5, 9]
    assert level_of_timestep(torch.tensor([104]), 105, 10).tolist() == [9]  # remainder steps stay on the last level
    assert level_of_timestep(torch.tensor([999]), 1000, 10).tolist() == [9]
    t = antithetic_timesteps(9, 100, torch.Generator().manual_seed(0))
    assert t.shape == (9,) and torch.all(t[:4] + t[5:9] == 99)


class _Oracle(torch.nn.Module):
    """A perfect denoiser for a known clean image, in either parametrisation."""

    def __init__(self, x0: torch.Tensor, abar: torch.Tensor, prediction: str) -> None:
        super().__init__()
        self.x0, self.abar, self.prediction = x0, abar, prediction

    def forward(self, inp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.prediction == "x0":
            return self.x0.expand(inp.shape[0], -1, -1, -1)
        a = self.abar[t.long()].view(-1, 1, 1, 1)
        return (inp[:, 3:] - a.sqrt() * self.x0) / (1 - a).sqrt()


@pytest.mark.parametrize("prediction", ["x0", "eps"])
def test_ddim_with_a_perfect_denoiser_returns_the_clean_image(prediction: str) -> None:
    model = LasqDiffusion(DiffusionConfig(timesteps=50, sample_steps=5, prediction=prediction))
    clean = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    model.net = _Oracle(to_signed(clean), model.abar, prediction)
    out = model.sample(torch.zeros(2, 3, 8, 8), torch.Generator().manual_seed(1))
    assert torch.allclose(out, clean.expand(2, -1, -1, -1), atol=1e-4)


# -- the registered run ------------------------------------------------------------------------------

TINY = ["params.images=[astronaut,coffee,chelsea]", "params.heldout=1", "params.short_side=40", "params.crop=16",
        "params.crops_per_image=4", "params.test_draws=1", "params.steps=3", "params.sup_steps=3", "params.batch=2",
        "params.width=4", "params.timesteps=20", "params.sample_steps=2", "params.levels=4", "params.niqe=false",
        "params.mcmc_steps=4"]


def test_same_seed_gives_identical_metrics_and_logs_tables_and_plots() -> None:
    cfg = C.load_central_config("lasq", TINY)
    cfg.tracking.enabled = False
    first, second = run_central(cfg), run_central(cfg)
    assert first.metrics == second.metrics
    m = first.metrics
    for key in ("psnr/in_range", "psnr/shifted/supervised", "ssim/shifted/global_gamma", "psnr/drop/lasq",
                "psnr/shifted/dark", "psnr/in_range/dark", "mcmc/acceptance"):
        assert key in m, key
    assert not any(k.startswith("claim/") for k in m)  # verdicts are the claim protocol's, with intervals
    assert m["psnr/in_range"] == m["psnr/in_range/lasq"]
    for method in ("lasq", "supervised", "dark"):
        assert m[f"psnr/drop/{method}"] == pytest.approx(m[f"psnr/in_range/{method}"] - m[f"psnr/shifted/{method}"])
    rows = first.tables["per_image"]
    for rng_name in ("in_range", "shifted"):  # the dark input's metric is the mean over its own test rows
        dark = [r["psnr"] for r in rows if r["method"] == "dark" and r["range"] == rng_name]
        assert m[f"psnr/{rng_name}/dark"] == pytest.approx(sum(dark) / len(dark))
    assert {"summary", "per_image", "mcmc"} <= set(first.tables)
    assert len(rows) == 2 * 6  # 2 ranges x 1 pair x (dark + 5 methods)
    cfg_other = C.load_central_config("lasq", TINY + ["params.methods=[global_gamma]"], seed=1)
    cfg_other.tracking.enabled = False
    other = run_central(cfg_other)
    assert other.metrics["psnr/shifted/dark"] != m["psnr/shifted/dark"]  # the seed redraws the darkening


def test_headline_keys_per_method_plain_keys_for_the_first_and_the_dark_input() -> None:
    from central.lasq.run import headline

    summary = [{"method": "dark", "psnr/shifted": 6.0, "psnr/in_range": 9.0, "psnr/drop": 3.0},
               {"method": "global_gamma", "psnr/shifted": 12.0, "psnr/in_range": 17.0, "psnr/drop": 5.0,
                "train_seconds": 0.0},
               {"method": "lasq", "psnr/shifted": 13.0, "psnr/in_range": 15.0, "psnr/drop": 2.0,
                "train_seconds": 9.0}]
    out = headline(LasqParams(methods=["lasq", "global_gamma"]), summary)
    assert out == {"psnr/shifted/lasq": 13.0, "psnr/in_range/lasq": 15.0, "psnr/drop/lasq": 2.0,
                   "psnr/shifted/global_gamma": 12.0, "psnr/in_range/global_gamma": 17.0,
                   "psnr/drop/global_gamma": 5.0, "psnr/shifted/dark": 6.0, "psnr/in_range/dark": 9.0,
                   "psnr/drop/dark": 3.0, "psnr/shifted": 13.0, "psnr/in_range": 15.0, "psnr/drop": 2.0}


def test_claim_spec_is_valid_every_child_is_read_and_its_metrics_are_logged() -> None:
    from tests.central.claim_spec import checked_claim_spec

    spec, grid = checked_claim_spec("lasq", check)
    comparisons = [*spec.claim, *spec.controls.positive]
    # the paper's claims: LASQ beats both unsupervised baselines at the shifted range, and the
    # supervised U-Net loses more under the shift (a lower psnr/drop is better)
    sides = {(c.better["params.methods"][0], c.worse["params.methods"][0], c.metric or spec.metric,
              c.higher_is_better) for c in spec.claim}
    assert sides == {("lasq", "global_gamma", "psnr/shifted", True), ("lasq", "pixel_gamma", "psnr/shifted", True),
                     ("lasq", "supervised", "psnr/drop", False)}
    assert all(c.margin > 0 and c.kind == "superiority" for c in spec.claim)
    assert spec.metric == "psnr/shifted" and len(spec.seeds) >= 3 and spec.controls.positive
    assert spec.controls.floor.value < spec.controls.ceiling.value
    # every metric a verdict reads is one a child logs (a one-method run, as the grid's children)
    cfg = C.load_central_config("lasq", TINY + ["params.methods=[global_gamma]"])
    cfg.tracking.enabled = False
    logged = set(run_central(cfg).metrics)
    assert {m for c in comparisons for m in c.metrics(spec.metric)} <= logged
    assert set(spec.extra_metrics) <= logged


def test_niqe_is_computed_only_where_valid() -> None:
    from central.lasq.run import niqe_skip_reason

    test = ["astronaut", "coffee", "china"]  # 512², 400×600, 427×640
    assert niqe_skip_reason(LasqParams(niqe=False), test) is None
    assert "short_side=256 < 384" in niqe_skip_reason(LasqParams(), test)  # the default: skipped
    assert niqe_skip_reason(LasqParams(short_side=384), test) is None
    assert "test images coffee, china are" in niqe_skip_reason(LasqParams(short_side=448), test)  # would be upsampled


def test_a_run_below_the_niqe_size_skips_it_with_a_logged_reason(caplog) -> None:
    cfg = C.load_central_config("lasq", [t for t in TINY if "niqe" not in t] + ["params.niqe=true",
                                                                                 "params.methods=[global_gamma]"])
    cfg.tracking.enabled = False
    with caplog.at_level("WARNING", logger="fedsim.lasq"):
        out = run_central(cfg)
    assert any("NIQE not computed: short_side=40 < 384" in r.getMessage() for r in caplog.records)
    assert not any("niqe" in k for k in out.metrics) and all("niqe" not in r for r in out.tables["per_image"])


@pytest.mark.parametrize("bad", [
    {"methods": []}, {"methods": ["lasq", "nope"]}, {"methods": ["lasq", "lasq"]}, {"images": ["lena"]},
    {"heldout": 0}, {"crop": 30}, {"short_side": 4}, {"steps": 0}, {"train_gain": [0.6, 0.2]},
    {"shift_gamma": [1.0]}, {"noise": [-0.1, 0.1]}, {"gamma_bounds": [1.0, 1.0]}, {"temperature": 0.0},
    {"proposal_std": -1.0}, {"exposure_target": 1.5}, {"levels": 200}, {"prediction": "v"},
    {"scc_batch": 99}, {"luminance_sigmas": [0.0]}, {"scc_every": 0},
])
def test_bad_params_give_a_one_line_config_error(bad: dict) -> None:
    with pytest.raises(ConfigError) as err:
        check(LasqParams(**bad))
    assert "\n" not in str(err.value)


def test_cli_rejects_bad_params_in_one_line(capsys) -> None:
    assert main(["run", "lasq", "params.temperature=0", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "temperature" in err[0]
