"""ParetoQ: quantiser level sets, straight-through and LSQ gradients, byte counting, the budget split."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedsim.central_runner import run_central
from central.lm import tiny
from central.paretoq import quant as Q
from central.paretoq import run as R
from fedsim import config as C
from fedsim.errors import ConfigError

CASES = [(1.0, "lsq", 2), (1.58, "seq", 3), (2.0, "seq", 4), (3.0, "lsq", 8), (4.0, "lsq", 16), (2.0, "lsq", 4)]


def _weights(rows: int = 6, cols: int = 200, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.05


@pytest.mark.parametrize("bits,quantizer,n_levels", CASES)
@pytest.mark.parametrize("alpha_factor", [1.0, 0.4])  # the authors' init, and a smaller scale that clips
def test_each_quantiser_maps_rows_onto_its_documented_levels(bits, quantizer, n_levels, alpha_factor) -> None:
    w = _weights()
    alpha = Q.init_scale(w, bits) * alpha_factor
    q = Q.quantize(w, alpha, bits, quantizer)
    allowed = Q.levels(bits, quantizer)
    assert len(allowed) == n_levels
    for row, a in zip(q, alpha[:, 0]):
        values = torch.unique(row)
        assert len(values) <= n_levels
        units = values / a
        assert torch.all((units[:, None] - allowed[None, :]).abs().min(dim=1).values < 1e-9), units
    if alpha_factor < 1 or bits in (1.0, 1.58):  # 200 weights a row reach every level (at init α = max|w|/Qp
        assert all(len(torch.unique(row)) == n_levels for row in q)  # the 3/4-bit rows never reach −2^(b−1))


def test_documented_levels_are_the_papers() -> None:
    assert Q.levels(1.58, "seq").tolist() == pytest.approx([-2 / 3, 0, 2 / 3])
    assert Q.levels(2, "seq").tolist() == pytest.approx([-0.75, -0.25, 0.25, 0.75])
    assert Q.levels(1, "lsq").tolist() == [-1, 1]
    assert Q.levels(3, "lsq").tolist() == list(range(-4, 4))
    assert Q.levels(4, "lsq").tolist() == list(range(-8, 8))


def test_one_bit_is_sign_times_alpha_even_at_zero() -> None:
    w = torch.tensor([[0.3, -0.2, 0.0, 0.1]], dtype=torch.float64)
    alpha = Q.init_scale(w, 1)
    assert alpha.item() == pytest.approx(0.15)  # mean |w|
    assert Q.quantize(w, alpha, 1, "lsq").tolist() == [[0.15, -0.15, 0.15, 0.15]]


def test_initial_scales_follow_the_authors() -> None:
    w = torch.tensor([[0.7, -1.4, 0.35], [0.1, 0.2, -0.3]], dtype=torch.float64)
    assert Q.init_scale(w, 1)[:, 0].tolist() == pytest.approx([0.8166667, 0.2])
    for b in (1.58, 2):
        assert Q.init_scale(w, b)[:, 0].tolist() == pytest.approx([1.4, 0.3])
    assert Q.init_scale(w, 3)[:, 0].tolist() == pytest.approx([1.4 / 3, 0.1])
    assert Q.init_scale(w, 4)[:, 0].tolist() == pytest.approx([0.2, 0.3 / 7])


@pytest.mark.parametrize("bits,quantizer,lo,hi", [(1.0, "lsq", -1, 1), (3.0, "lsq", -4, 3), (4.0, "lsq", -8, 7),
                                                  (1.58, "seq", -0.99, 0.99), (2.0, "seq", -0.99, 0.99)])
def test_straight_through_inside_the_clip_range_and_zero_outside(bits, quantizer, lo, hi) -> None:
    alpha = torch.tensor([[0.5]], dtype=torch.float64)
    units = torch.tensor([[lo - 0.7, lo - 0.01, lo + 0.01, 0.0, 0.3, hi - 0.01, hi + 0.01, hi + 2.0]],
                         dtype=torch.float64)
    w = (units * alpha).requires_grad_()
    upstream = torch.arange(1.0, 9.0, dtype=torch.float64)[None]
    (Q.quantize(w, alpha, bits, quantizer) * upstream).sum().backward()
    inside = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.float64)
    assert torch.equal(w.grad, inside * upstream)


def _lsq_reference(w: torch.Tensor, alpha: torch.Tensor, bits: float) -> torch.Tensor:
    """LSQ as Esser et al. write it with autograd: gradient-scaled step, clamp, round with an STE."""
    qn, qp = Q._lsq_range(bits)
    g = 1.0 / math.sqrt(w.numel() * qp)
    a = alpha * g + (alpha - alpha * g).detach()
    v = torch.clamp(w / a, qn, qp)
    return (v + (torch.round(v) - v).detach()) * a


@pytest.mark.parametrize("bits", [2.0, 3.0, 4.0])
def test_lsq_scale_gradient_matches_an_independent_autograd_lsq(bits) -> None:
    w = _weights(4, 50, seed=1)
    alpha = (Q.init_scale(w, bits) * 0.6).requires_grad_()  # some weights clip at both ends
    upstream = torch.randn(w.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (Q.quantize(w, alpha, bits, "lsq") * upstream).sum().backward()
    ours = alpha.grad.clone()
    alpha.grad = None
    (_lsq_reference(w, alpha, bits) * upstream).sum().backward()
    assert torch.allclose(ours, alpha.grad, atol=1e-12)
    clipped = (w / alpha.detach()).abs() > 2 ** (bits - 1) - 1
    assert clipped.any()


@pytest.mark.parametrize("bits,quantizer", [(1.0, "lsq"), (2.0, "seq"), (3.0, "lsq"), (4.0, "lsq"), (1.58, "seq")])
def test_scale_gradient_is_finite_difference_plus_the_straight_through_term(bits, quantizer) -> None:
    """d/dα of Σ q·G by central differences (rounding held fixed) is Σ_row q(w/α)·G; the authors'
    gradient adds the straight-through term −Σ_row (w/α)·G inside the clip range and scales by s."""
    w = _weights(3, 40, seed=3)
    alpha = (Q.init_scale(w, bits) * (1.0 if bits == 1.0 else 0.7)).requires_grad_()
    upstream = torch.randn(w.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (Q.quantize(w, alpha, bits, quantizer) * upstream).sum().backward()
    qp = Q._lsq_range(bits)[1]
    s = 1.0 / math.sqrt(w.numel() * qp)
    h = 1e-9
    with torch.no_grad():
        up = (Q.quantize(w, alpha + h, bits, quantizer) * upstream).sum(dim=1)
        down = (Q.quantize(w, alpha - h, bits, quantizer) * upstream).sum(dim=1)
        fd = (up - down) / (2 * h)
        v = w / alpha
        lo, hi = (-0.99, 0.99) if quantizer == "seq" else Q._lsq_range(bits)
        inside = (v >= lo) & (v <= hi)
        ste = (inside * v * upstream).sum(dim=1) if bits != 1.0 else torch.zeros_like(fd)
        if bits == 1.58:  # the authors' code: a clipped ternary weight's α-gradient is ±1, its value ±2/3
            clipped = (~inside * torch.sign(v) * upstream).sum(dim=1)
            fd = fd + clipped * (1 - 2 / 3)
    assert torch.allclose(alpha.grad[:, 0] / s, fd - ste, atol=1e-5)


def _toy_model() -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(10, 16)
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 8, bias=False))])
    model.norm = nn.LayerNorm(16, elementwise_affine=False)
    return model


@pytest.mark.parametrize("bits,weight_bytes", [(1, 16), (1.58, 26), (2, 32), (3, 48), (4, 64)])
def test_model_bytes_are_exact_for_a_known_layer(bits, weight_bytes) -> None:
    model = _toy_model()
    assert Q.quantize_model(model, bits) == ["layers.0.0"]
    count = Q.model_bytes(model, fp_bits=16, scale_bits=16)
    assert (count.quantized_weights, count.scales, count.full_precision) == (weight_bytes, 8 * 2, 10 * 16 * 2)
    assert count.total == weight_bytes + 16 + 320


def test_quantize_model_swaps_exactly_the_block_linears_of_the_tiny_llama() -> None:
    model = tiny.build(tiny.preset("test"))
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    names = Q.quantize_model(model, 2)
    assert len(names) == 7 * model.config.num_hidden_layers
    layers = Q.quant_layers(model)
    assert set(layers) == set(names) and all(m.weight is weights[n] for n, m in layers.items())
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 512) and torch.isfinite(logits).all()


def test_budget_split_and_recipe_fraction() -> None:
    assert R.split_budget(200, 0.0) == (200, 0)
    assert R.split_budget(200, 0.1) == (180, 20)
    assert R.split_budget(200, 1.0) == (0, 200)
    assert R.recipe_fraction([0.0, 0.05, 0.1, 0.2, 1.0]) == 0.1
    assert R.recipe_fraction([0.0, 0.5]) == 0.5 and R.recipe_fraction([0.0, 1.0]) is None
    spec = R.base_spec(R.ParetoQParams(preset="drafter", budget_steps=200))  # drafter: 100 of 800 steps warm up
    assert (R.fp_recipe_spec(spec, 180).steps, R.fp_recipe_spec(spec, 180).warmup) == (180, 22)
    assert R.qat_recipe(spec, 1e-3, 20, from_scratch=False) == tiny.Recipe(1e-3, 0, 0.0, (0.9, 0.999), 0.0)
    assert R.qat_recipe(spec, 1e-3, 200, from_scratch=True).warmup == 25


def test_pareto_front_keeps_only_undominated_points() -> None:
    def pt(bits: float, nbytes: int, loss: float) -> R.Point:
        return R.Point(64, bits, 0.1, 9, 1, loss, Q.ByteCount(nbytes, 0, 0))

    a, b, c, d = pt(1, 100, 3.0), pt(2, 200, 2.5), pt(3, 300, 2.6), pt(4, 400, 2.4)
    assert R.pareto_front([d, c, b, a]) == [a, b, d]


def _tiny_params(**changes: object) -> R.ParetoQParams:
    base = dict(preset="test", widths=[16], n_layers=1, batch_size=2, seq_len=32, corpus_chars=60_000,
                budget_steps=6, bits=[2.0], fractions=[0.0], eval_chars=20_000, eval_windows=4)
    base.update(changes)
    return R.ParetoQParams(**base)  # type: ignore[arg-type]


def test_qat_fraction_zero_is_post_training_quantisation_of_the_fp_model() -> None:
    p = _tiny_params()
    with R.torch_threads(1):
        points = R.sweep(p, lambda *stream: 7)
    fp, q = points
    assert (fp.bits, fp.fp_steps, q.bits, q.qat_steps) == (16.0, 6, 2.0, 0)
    spec = R.width_spec(R.base_spec(p), 16, 7)
    data = R.load_data(spec, p.eval_chars)
    with R.torch_threads(1):
        model = R.train_fp(spec, data.train, 6)
        assert tiny.mean_loss(model, data.heldout, spec.seq_len, 4) == fp.loss
        Q.quantize_model(model, 2)
        assert tiny.mean_loss(model, data.heldout, spec.seq_len, 4) == q.loss
    assert q.change_latent == 0.0 and q.change_quantized > 0


def test_same_seed_gives_identical_metrics_through_the_runner(tmp_path) -> None:
    path = tmp_path / "pq.yaml"
    path.write_text("method: paretoq\nseed: 3\ntracking: {enabled: false}\nparams:\n"
                    "  preset: test\n  widths: [16]\n  n_layers: 1\n  batch_size: 2\n  seq_len: 32\n"
                    "  corpus_chars: 60000\n  budget_steps: 4\n  bits: [1, 4]\n  fractions: [0.0, 0.5]\n"
                    "  eval_chars: 20000\n  eval_windows: 4\n")
    a = run_central(C.load_central_config(str(path)))
    b = run_central(C.load_central_config(str(path)))
    assert a.metrics == b.metrics
    untimed = [[{k: v for k, v in row.items() if k != "seconds"} for row in s.tables["results"]] for s in (a, b)]
    assert untimed[0] == untimed[1]
    assert {"heldout_loss/mean_bits", "best_qat_fraction/b1", "weight_change/b4", "pareto/on_front/b4"} <= set(a.metrics)
    assert len(a.tables["results"]) == 2 * (1 + 2)  # per fraction: the FP model and two bit widths
    qat = [r for r in a.tables["results"] if r["qat_steps"] == 2]
    assert len(qat) == 2 and all(r["weight_change_latent"] > 0 for r in qat)


@pytest.mark.parametrize("override,message", [("params.bits=[5]", "not a ParetoQ bit width"),
                                              ("params.fractions=[1.5]", "must lie in [0, 1]"),
                                              ("params.fractions=[0.001]", "rounds to"),
                                              ("params.seq_bits=[3]", "SEQ is defined"),
                                              ("params.widths=[30]", "multiple of n_heads"),
                                              ("params.preset=huge", "params.preset")])
def test_bad_params_are_one_line_config_errors(override, message) -> None:
    cfg = C.load_central_config("paretoq", [override, "tracking.enabled=false"])
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        run_central(cfg)
    assert "\n" not in str(info.value)


def test_claim_spec_grids_the_qat_fraction_over_valid_configs_and_reads_what_a_run_logs(tmp_path) -> None:
    from tests.central.claim_spec import checked_claim_spec, logged_metrics, read_metrics

    spec, grid = checked_claim_spec("paretoq", R.check)
    fractions = [f for setting in grid for f in setting["params.fractions"]]
    assert fractions == [0.0, 0.1, 0.2, 1.0] and spec.metric == "heldout_loss/mean_bits" and spec.has_protocol
    assert len(spec.seeds) >= 3 and spec.controls.positive and spec.controls.floor.value == pytest.approx(6.238, abs=1e-3)
    # the spec's widths and bit widths on the test preset, both fractions its claims read by name
    path = tmp_path / "pq.yaml"
    path.write_text("method: paretoq\nseed: 0\ntracking: {enabled: false}\nparams:\n"
                    "  preset: test\n  widths: [64, 96]\n  n_layers: 1\n  batch_size: 2\n  seq_len: 32\n"
                    "  corpus_chars: 60000\n  budget_steps: 10\n  bits: [1, 1.58, 2, 3, 4]\n  fractions: [0.0, 0.1]\n"
                    "  eval_chars: 20000\n  eval_windows: 2\n")
    missing = read_metrics(spec) - logged_metrics(run_central(C.load_central_config(str(path))))
    assert not missing, f"the claim spec reads metrics no run logs: {sorted(missing)}"
