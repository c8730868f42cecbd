"""DEFT: the W′ formula, the projector, q modes, step-0 identities, budgets, conv = linear, the run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsim.central_runner import run_central
from central.deft.layers import (AdapterSpec, DeftLayer, LoraLayer, ParaLayer, as_matrix, make_adapter,
                                 nominal_parameters, orthonormal_basis, wrap_model)
from central.deft.models import SmallCNN
from central.deft.run import DeftParams, check
from central.deft.tradeoff import best_new_at_retention, hypervolume, normalised_hypervolume, pareto_front
from fedsim import config as C
from fedsim.cli import main
from fedsim.errors import ConfigError


def _linear(out_dim: int = 12, in_dim: int = 7, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_dim, out_dim)


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- the formula and the projector ------------------------------------------------------------------

@pytest.mark.parametrize("gate", [False, True])
def test_deft_weight_and_output_equal_the_formula(gate: bool) -> None:
    base = _linear()
    layer = DeftLayer(base, AdapterSpec("deft", rank=3, gate=gate), _gen())
    with torch.no_grad():
        layer.R.normal_()  # away from the tiny init, so QR is not negligible
        if gate:
            layer.gate.fill_(-0.7)
    W = base.weight.detach()
    Q, _ = torch.linalg.qr(layer.P.detach())
    g = torch.sigmoid(torch.tensor(-0.7)) if gate else 1.0
    expected = W - Q @ Q.T @ W + g * Q @ layer.R.detach()
    assert torch.allclose(layer.weight(), expected, atol=1e-6)
    x = torch.randn(5, 7)
    assert torch.allclose(layer(x), x @ expected.T + base.bias, atol=1e-5)
    assert not torch.allclose(layer.weight(), W, atol=1e-3)  # the authors' init changes the layer


def test_projector_is_idempotent_and_q_orthonormal() -> None:
    P = torch.randn(20, 5, generator=_gen(3)) * 0.02
    Q = orthonormal_basis(P)
    proj = Q @ Q.T
    assert torch.allclose(Q.T @ Q, torch.eye(5), atol=1e-5)
    assert torch.allclose(proj @ proj, proj, atol=1e-5)
    assert torch.allclose(proj @ P, P, atol=1e-6)  # Q spans P
    assert abs(float(torch.trace(proj)) - 5.0) < 1e-4  # rank r


def test_deft_removes_the_subspace_and_injects_only_inside_it() -> None:
    layer = DeftLayer(_linear(), AdapterSpec("deft", rank=4), _gen())
    Q = layer.basis()
    delta = layer.weight() - layer.base.weight
    complement = torch.eye(12) - Q @ Q.T
    assert torch.allclose(complement @ delta, torch.zeros_like(delta), atol=1e-6)  # W′ − W lies in span(Q)
    assert torch.allclose(complement @ layer.weight(), complement @ layer.base.weight, atol=1e-6)
    assert torch.allclose(Q.T @ layer.weight(), layer.R, atol=1e-6)  # inside span(Q), W is replaced by R


# -- q modes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_mode, p_trains", [("cached", False), ("trained", True)])
def test_p_gets_a_gradient_only_in_trained_mode(q_mode: str, p_trains: bool) -> None:
    layer = DeftLayer(_linear(), AdapterSpec("deft", rank=3, q_mode=q_mode, gate=True), _gen())
    layer(torch.randn(6, 7)).pow(2).sum().backward()
    assert (layer.P.grad is not None and float(layer.P.grad.abs().sum()) > 0) == p_trains
    assert float(layer.R.grad.abs().sum()) > 0 and float(layer.gate.grad.abs().sum()) > 0
    assert layer.base.weight.grad is None  # the pretrained weight is frozen
    q_before = layer.basis().clone()
    with torch.no_grad():
        layer.P.add_(torch.randn_like(layer.P))
    assert torch.equal(layer.basis(), q_before) != p_trains  # cached: Q does not follow P


def test_cached_mode_p_never_changes_under_adam() -> None:
    layer = DeftLayer(_linear(), AdapterSpec("deft", rank=2), _gen())
    p0 = layer.P.detach().clone()
    opt = torch.optim.Adam([q for q in layer.parameters() if q.requires_grad], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        layer(torch.randn(4, 7)).sum().backward()
        opt.step()
    assert torch.equal(layer.P.detach(), p0)
    assert layer.effective_parameters() == 2 * 7  # R only


# -- step-0 identities ------------------------------------------------------------------------------

def test_zero_initialised_pieces_reproduce_the_pretrained_layer() -> None:
    base = _linear()
    x = torch.randn(3, 7)
    lora = LoraLayer(base, AdapterSpec("lora", rank=3), _gen())
    assert torch.equal(lora.weight(), base.weight) and torch.allclose(lora(x), base(x))
    for gate in (False, True):
        keep = DeftLayer(base, AdapterSpec("deft", rank=3, gate=gate, deft_init="preserve"), _gen())
        assert torch.allclose(keep.weight(), base.weight, atol=1e-6)
    para = ParaLayer(base, AdapterSpec("para", rank=3), _gen())
    Q = orthonormal_basis(para.P)
    assert torch.allclose(para.weight(), base.weight - Q @ Q.T @ base.weight, atol=1e-6)


# -- budgets ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["deft", "lora", "para"])
@pytest.mark.parametrize("base", [nn.Linear(30, 10), nn.Conv2d(4, 6, 3)])
def test_parameter_counts(kind: str, base: nn.Module) -> None:
    out_dim, in_dim = as_matrix(base.weight).shape
    layer = make_adapter(base, AdapterSpec(kind, rank=3, gate=True), _gen())
    trainable = sum(p.numel() for p in layer.parameters() if p.requires_grad)
    assert trainable == nominal_parameters(kind, out_dim, in_dim, 3, gate=True)
    if kind != "para":  # DEFT and LoRA: the same budget at the same rank (plus DEFT's one gate scalar)
        assert trainable - int(kind == "deft") == 3 * (out_dim + in_dim)


def test_wrap_model_leaves_only_adapters_trainable() -> None:
    cnn = SmallCNN(4, 6, 8)
    adapters = wrap_model(cnn, ["conv1", "conv2", "fc1"], AdapterSpec("lora", rank=2), _gen())
    names = {n for n, p in cnn.named_parameters() if p.requires_grad}
    assert names == {f"{t}.{w}" for t in ("conv1", "conv2", "fc1") for w in ("A", "B")}
    assert sum(a.effective_parameters() for a in adapters.values()) == sum(
        2 * (o + i) for o, i in ((4, 9), (6, 36), (8, 6 * 49)))
    assert cnn(torch.randn(2, 1, 28, 28)).shape == (2, 8)


# -- conv = linear on the reshaped kernel -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["deft", "lora", "para"])
def test_conv_wrapper_equals_the_linear_formula_on_the_reshaped_kernel(kind: str) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, padding=1, stride=2)
    layer = make_adapter(conv, AdapterSpec(kind, rank=2, q_mode="trained"), _gen())
    with torch.no_grad():
        for p in layer.parameters():
            if p.requires_grad:
                p.normal_()
    W2 = as_matrix(conv.weight)
    if kind == "deft":
        Q = orthonormal_basis(layer.P)
        expected = W2 - Q @ Q.T @ W2 + Q @ layer.R
    elif kind == "lora":
        expected = W2 + layer.scaling * layer.B @ layer.A
    else:
        Q = orthonormal_basis(layer.P)
        expected = W2 - Q @ Q.T @ W2
    x = torch.randn(2, 3, 9, 9)
    cols = F.unfold(x, 3, padding=1, stride=2)  # (N, in·k·k, L): the conv as a matrix product
    linear = (expected @ cols + conv.bias[:, None]).reshape(2, 5, 5, 5)
    assert torch.allclose(layer(x), linear, atol=1e-4)


# -- trade-off summaries ----------------------------------------------------------------------------

def test_pareto_front_and_hypervolume() -> None:
    pts = [(0.9, 0.5), (0.8, 0.7), (0.85, 0.4), (0.6, 0.7), (0.5, 0.9)]
    assert pareto_front(pts) == [(0.9, 0.5), (0.8, 0.7), (0.5, 0.9)]
    ref = (0.2, 0.2)
    expected = 0.7 * 0.3 + 0.6 * 0.2 + 0.3 * 0.2
    assert math.isclose(hypervolume(pts, ref), expected)
    assert math.isclose(normalised_hypervolume([(1.0, 1.0)], ref), 1.0)
    assert hypervolume(pts + [(0.7, 0.6)], ref) == hypervolume(pts, ref)  # dominated points add nothing
    assert best_new_at_retention(pts, 0.8, 0.2) == 0.7 and best_new_at_retention(pts, 0.95, 0.2) == 0.2


# -- the run ----------------------------------------------------------------------------------------

TINY = ["params.methods=[deft_cached,deft_trained,lora,para,head]", "params.ranks=[1,2]", "params.rank=2",
        "params.lrs=[0.01]", "params.lr=0.01", "params.steps=3", "params.eval_steps=[0,3]", "params.shots=3",
        "params.test_per_class=20", "params.widths=[4,8,16]", "params.pretrain_epochs=1"]


def test_same_seed_gives_identical_metrics_and_logs_tables() -> None:
    cfg = C.load_central_config("deft", TINY)
    cfg.tracking.enabled = False
    first, second = run_central(cfg), run_central(cfg)
    assert first.metrics == second.metrics
    m = first.metrics
    assert m["hv"] == m["hv/deft_cached"] and m["new_at_retain"] == m["new_at_retain/deft_cached"]
    methods = ("deft_cached", "deft_trained", "lora", "para", "head")
    for key in ("hv", "new_at_retain", "new_acc", "retention"):  # real metrics only, in [0, 1], per method
        assert all(0.0 <= m[f"{key}/{method}"] <= 1.0 for method in methods)
    assert not [k for k in m if k.startswith("claim/")]  # no margin-less flags: `fedsim reproduce deft` decides
    assert m["trainable/deft_cached"] == m["trainable/lora"]  # equal budget at equal rank
    assert m["effective_trainable/deft_cached"] < m["trainable/deft_cached"]  # P frozen in effect
    assert m["trainable/head"] == 0 and m["retention/head"] == m["pretrained/old_acc"]
    assert len(first.tables["points"]) == 2 * (4 * 2 + 1) and len(first.tables["summary"]) == 5
    other = run_central(C.load_central_config("deft", TINY, seed=1))
    assert other.metrics != first.metrics


def test_claim_spec_is_valid_and_every_child_is_read_by_a_verdict() -> None:
    from tests.central.claim_spec import checked_claim_spec

    spec, grid = checked_claim_spec("deft", check)
    # the paper's claim: DEFT (authors' default, Q cached) beats LoRA and PaRa, on hv and on new_at_retain
    pairs = {(c.better["params.methods"][0], c.worse["params.methods"][0], c.metric or spec.metric)
             for c in spec.claim}
    assert pairs == {("deft_cached", b, m) for b in ("lora", "para") for m in ("hv", "new_at_retain")}
    assert all(c.margin > 0 and c.kind == "superiority" for c in spec.claim)
    assert spec.metric == "hv" and len(spec.seeds) >= 3 and spec.has_protocol and spec.controls.positive
    assert spec.controls.floor.value == 0.0 and spec.controls.ceiling.value == 1.0


@pytest.mark.parametrize("bad", [
    {"setting": "cifar"}, {"methods": []}, {"methods": ["deft_cached", "dora"]}, {"ranks": [0, 4]},
    {"rank": 3}, {"ranks": [4, 4]}, {"eval_steps": [0, 50]}, {"eval_steps": [10, 5, 100]}, {"lrs": [0.0, 0.01]},
    {"lr": 0.5}, {"shots": 0}, {"shots": 450}, {"test_per_class": 500}, {"old_classes": [0, 0, 1]},
    {"old_classes": [0, 11]}, {"deft_init": "zero"}, {"retain_frac": 1.5}, {"widths": [4, 8]},
    {"ranks": [4, 10], "methods": ["lora"]}, {"ranks": [4, 16], "methods": ["para"]}, {"text_max_len": 2},
])
def test_bad_params_give_a_one_line_config_error(bad: dict) -> None:
    with pytest.raises(ConfigError) as err:
        check(DeftParams(**bad))
    assert "\n" not in str(err.value)


def test_cli_rejects_bad_params_in_one_line(capsys) -> None:
    assert main(["run", "deft", "params.shots=0", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shots" in err[0]


@pytest.mark.slow
@pytest.mark.parallel
def test_text_setting_tail_matches_minilm_and_runs() -> None:
    from central.deft.models import minilm, minilm_prefix_states, minilm_tail

    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102, 0, 0], [101, 7592, 102, 0, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        full = minilm()(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (full * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        assert torch.allclose(minilm_tail()(minilm_prefix_states(ids)), pooled, atol=1e-5)
    cfg = C.load_central_config("deft", TINY[:-3] + ["params.setting=text", "params.text_per_class=12",
                                                     "params.test_per_class=6", "params.text_max_len=16"])
    cfg.tracking.enabled = False
    m = run_central(cfg).metrics
    dims = [(384, 384)] * 4 + [(1536, 384), (384, 1536)]  # q, k, v, attention out, intermediate, output
    assert m["trainable/deft_cached"] == m["trainable/lora"] == sum(2 * (o + i) for o, i in dims)  # rank 2
    assert m["effective_trainable/deft_cached"] == sum(2 * i for _, i in dims)
    assert m["retention/head"] == m["pretrained/old_acc"]
