"""TTA methods (clients/tta/methods/): what they may change, online prediction, ETA/LCoTTA
equivalence without projection, LCoTTA's snapshot schedule and projection, RDumb's resets, state
round trips, determinism and config errors."""

from __future__ import annotations

import copy

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from sklearn.decomposition import PCA
from torch import nn

from clients.tta import TTA_METHODS, build_method, collect_norm_params, make_params, norm_dim
from clients.tta.norm import NORM_TYPES
from clients.tta.subspace import project
from fedsim.errors import ConfigError

C = 5
GRAD_METHODS = ["tent", "eata", "rdumb", "lcotta"]
LOOSE = {"e0_margin": 1.0, "d_margin": 1.01}  # every sample passes both ETA filters


pytestmark = pytest.mark.usefixtures("one_thread")


class Scale(nn.Module):
    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def bn_net(seed: int = 0) -> nn.Module:
    """Conv + BN2d + BN1d; logits scaled so that entropies spread around E0 = 0.4·ln C."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, C), Scale(6.0),
    )


def ln_net(seed: int = 0) -> nn.Module:
    """LayerNorm + GroupNorm only (the 'ViT-like' case: outputs are per sample)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(36, 8), nn.LayerNorm(8), nn.ReLU(), nn.Unflatten(1, (4, 2)),
        nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(8, C), Scale(6.0),
    )


NETS = {"bn": bn_net, "ln": ln_net}


def stream(n: int, bs: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(bs, 1, 6, 6, generator=g) + 0.3 * (i % 3) for i in range(n)]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def norm_names(model: nn.Module) -> set[str]:
    return set(collect_norm_params(model)[1])


def run(method, batches) -> list[torch.Tensor]:
    return [method(x) for x in batches]


# ------------------------------------------------------------------------------- what changes


@pytest.mark.parametrize("net", ["bn", "ln"])
@pytest.mark.parametrize("name", GRAD_METHODS)
def test_only_norm_affine_params_change(name, net):
    model = NETS[net]()
    before = params_of(model)
    m = build_method(name, model, C, {"lr": 0.05} if name == "tent" else {"lr": 0.05, **LOOSE})
    run(m, stream(6))
    after = params_of(model)
    adapted = norm_names(model)
    assert adapted
    for n in before:
        if n in adapted:
            continue
        assert torch.equal(before[n], after[n]), n  # bit-identical
    assert any(not torch.equal(before[n], after[n]) for n in adapted)
    assert all(p.requires_grad == (n in adapted) for n, p in model.named_parameters())


def test_configure_uses_batch_stats_and_freezes():
    model = bn_net()
    build_method("tent", model, C)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            assert m.running_mean is None and m.running_var is None and not m.track_running_stats
        if isinstance(m, NORM_TYPES):
            assert all(p.requires_grad for p in m.parameters())
    assert not model.training


def test_source_leaves_model_unchanged():
    model = bn_net()
    # give BN non-trivial running statistics, as a trained source model has
    model.train()
    with torch.no_grad():
        for x in stream(3, seed=9):
            model(x)
    reference = copy.deepcopy(model).eval()
    state = copy.deepcopy(model.state_dict())
    m = build_method("source", model, C)
    x = stream(2)
    for xb in x:
        assert torch.equal(m(xb), reference(xb))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert m.state_dict() == {}
    # eval mode: a sample's logits do not depend on its batch
    assert torch.allclose(m(x[0])[:4], m(torch.cat([x[0][:4], x[1][4:]]))[:4], atol=1e-6)


def test_bn_adapt_uses_batch_stats_without_changing_params():
    model = bn_net()
    before = params_of(model)
    m = build_method("bn_adapt", model, C)
    a, b = stream(2)
    mixed = torch.cat([a[:4], b[4:]])
    assert not torch.allclose(m(a)[:4], m(mixed)[:4])  # same samples, other companions
    assert torch.equal(m(a), m(a))  # no state carried between batches
    after = params_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", GRAD_METHODS)
def test_returned_logits_are_pre_update(name):
    m = build_method(name, bn_net(), C, {"lr": 0.1} if name == "tent" else {"lr": 0.1, **LOOSE})
    for x in stream(4):
        frozen = copy.deepcopy(m.model)
        with torch.no_grad():
            expected = frozen(x)
        out = m(x)
        assert torch.equal(out, expected)
        assert not out.requires_grad
        with torch.no_grad():
            assert not torch.equal(m.model(x), expected)  # the model did adapt on this batch


# -------------------------------------------------------------------- LCoTTA vs ETA (ablation)

ETA_P = {"lr": 0.1, "e0_margin": 0.4, "d_margin": 0.8}  # C = 5: one-hot vs uniform EMA has cos 0.45


def lockstep(a, b, batches):
    """Run two methods on the same batches; return the per-batch kept fractions of the first."""
    kept = []
    for x in batches:
        assert torch.equal(a(x), b(x))
        kept.append(a.last_info["kept_frac"])
        for (n, p), q in zip(zip(a.param_names, a.param_list), b.param_list):
            assert torch.equal(p, q), n
    return kept


def test_lcotta_without_projection_equals_eata_exactly():
    eata = build_method("eata", bn_net(), C, ETA_P)
    lcotta = build_method("lcotta", bn_net(), C, {**ETA_P, "project": False, "on_empty": "skip",
                                                  "rank": 2, "snapshot_every": 1, "window": 4})
    kept = lockstep(eata, lcotta, stream(12))
    assert any(0 < k < 1 for k in kept)  # both filters actually selected
    assert len(lcotta.window) == 4  # the window was tracked, just not used


def test_lcotta_with_full_rank_equals_eata():
    model = bn_net()
    d = norm_dim(model)
    eata = build_method("eata", bn_net(), C, ETA_P)
    lcotta = build_method("lcotta", model, C, {**ETA_P, "on_empty": "skip", "rank": d,
                                               "snapshot_every": 1, "window": d + 2})
    projected = 0.0
    for x in stream(d + 6):
        assert torch.allclose(eata(x), lcotta(x), atol=1e-4)
        projected += lcotta.last_info.get("projected", 0.0)
    assert projected >= 5  # projection with P of full rank D was really applied
    for p, q in zip(eata.param_list, lcotta.param_list):
        assert torch.allclose(p, q, atol=1e-5)


def test_lcotta_projection_differs_from_eata_at_low_rank():
    eata = build_method("eata", bn_net(), C, {**ETA_P, "on_empty": "step"})
    lcotta = build_method("lcotta", bn_net(), C, {**ETA_P, "rank": 2, "snapshot_every": 1, "window": 5})
    outs = [(eata(x), lcotta(x)) for x in stream(6)]
    assert all(torch.equal(a, b) for a, b in outs[:3])  # batches 0-2: warm-up, plain ETA step
    assert not torch.equal(*outs[3])  # the step of batch 2 was projected


# ------------------------------------------------------------------ LCoTTA snapshot schedule


def test_snapshot_schedule_fifo_and_projection_start():
    s, k, r = 3, 4, 2
    eata = build_method("eata", bn_net(), C, {**ETA_P, **LOOSE})
    grads: list[torch.Tensor] = []
    eata.step = lambda info: (grads.append(eata.flat_grad()), type(eata).step(eata, info))
    lcotta = build_method("lcotta", bn_net(), C, {**ETA_P, **LOOSE, "project": False,
                                                  "snapshot_every": s, "window": k, "rank": r})
    lengths = []
    for x in stream(17):
        eata(x)
        lcotta(x)
        lengths.append(len(lcotta.window))
    # snapshots at t = 3, 6, 9, 12, 15 (t > 0, t % s == 0); capacity 4 drops the oldest
    assert lengths == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4, 4]
    expected = torch.stack([grads[t] for t in (6, 9, 12, 15)])
    assert torch.equal(lcotta.window.matrix(), expected)  # raw gradients, oldest first
    assert 0 < lcotta.last_info["explained_var"] <= 1 and lcotta.last_info["projected"] == 0

    proj = build_method("lcotta", bn_net(), C, {**ETA_P, **LOOSE, "snapshot_every": s, "window": k, "rank": r})
    flags = []
    for x in stream(9):
        proj(x)
        flags.append(proj.last_info["projected"])
    assert flags == [0, 0, 0, 0, 0, 0, 1, 1, 1]  # starts at batch r·s = 6


def test_projected_step_matches_sklearn_pca_of_centred_window():
    m = build_method("lcotta", bn_net(), C, {**ETA_P, **LOOSE, "snapshot_every": 1, "window": 6, "rank": 3})
    seen = {}
    flat_grad, set_flat_grad = m.flat_grad, m.set_flat_grad
    m.flat_grad = lambda: seen.setdefault("raw", flat_grad())
    m.set_flat_grad = lambda g: (seen.setdefault("proj", g.clone()), set_flat_grad(g))
    batches = stream(8)
    for x in batches[:7]:
        m(x)
        seen.clear()
    m(batches[7])  # window of 6 snapshots (t = 2..7), projection active
    w = m.window.matrix().double().numpy()
    comps = torch.tensor(PCA(n_components=3, svd_solver="full").fit(w).components_, dtype=torch.float32)
    assert torch.allclose(seen["proj"], project(seen["raw"], comps), atol=1e-5)
    assert 0 < m.last_info["explained_var"] <= 1 and 0 < m.last_info["kept_grad_frac"] <= 1


# ------------------------------------------------------------------------------ empty batches


def test_empty_batch_eata_skips_lcotta_steps_on_momentum():
    p = {"lr": 0.1, **LOOSE}
    eata = build_method("eata", bn_net(), C, p)
    lcotta = build_method("lcotta", bn_net(), C, {**p, "snapshot_every": 1, "window": 8, "rank": 8})
    for x in stream(3):
        eata(x)
        lcotta(x)
    for m in (eata, lcotta):
        m.params.e0_margin = 1e-9  # no sample is reliable any more
    x = stream(4, seed=5)[3]

    before, mom = params_of(eata.model), eata.state_dict()
    eata(x)
    assert eata.last_info["kept_frac"] == 0 and eata.last_info["updated"] == 0
    assert all(torch.equal(before[k], v) for k, v in params_of(eata.model).items())
    assert all(torch.equal(mom[k], v) for k, v in eata.state_dict().items())

    lr, mu = 0.1, 0.9
    before = dict(zip(lcotta.param_names, [q.detach().clone() for q in lcotta.param_list]))
    mom = lcotta.state_dict()
    lcotta(x)
    assert lcotta.last_info["updated"] == 1 and lcotta.last_info["loss"] == 0.0
    for n, q in zip(lcotta.param_names, lcotta.param_list):
        buf = mu * mom[f"momentum.{n}"]  # zero gradient: buf ← μ·buf; Nesterov step −lr·μ·buf
        assert torch.allclose(q, before[n] - lr * mu * buf, atol=1e-7), n
    assert torch.equal(lcotta.window.matrix()[-1], torch.zeros(norm_dim(lcotta.model)))  # zero snapshot


# ------------------------------------------------------------------------------------- RDumb


@pytest.mark.parametrize("base", ["eata", "tent"])
def test_rdumb_resets_to_source_every_n_updates(base):
    m = build_method("rdumb", bn_net(), C, {"lr": 0.1, **LOOSE, "reset_after_num_updates": 4, "base": base})
    source = {k: v.clone() for k, v in m.shared_state().items()}
    resets = []
    for i, x in enumerate(stream(9), start=1):
        m(x)
        resets.append(m.last_info["reset"])
        at_source = all(torch.equal(source[k], v) for k, v in m.shared_state().items())
        assert at_source == (i % 4 == 0), i
        if i % 4 == 0:
            assert set(m.state_dict()) == {"performed_updates"}  # optimizer and EMA reset too
    assert resets == [0, 0, 0, 1, 0, 0, 0, 1, 0]
    assert int(m.state_dict()["performed_updates"]) == 9  # the counter survives the resets


# ------------------------------------------------------------------------------ state and reset

ROUND_TRIP = {
    "tent": {"lr": 0.1},
    "eata": {"lr": 0.1},
    "rdumb": {"lr": 0.1, "reset_after_num_updates": 7},
    "lcotta": {"lr": 0.1, "snapshot_every": 1, "window": 4, "rank": 2},
}


@pytest.mark.parametrize("name", GRAD_METHODS)
def test_state_round_trip_continues_identically(name):
    batches = stream(10)
    straight = run(build_method(name, bn_net(), C, ROUND_TRIP[name]), batches)

    first = build_method(name, bn_net(), C, ROUND_TRIP[name])
    run(first, batches[:5])
    record = RecordDict({"shared": ArrayRecord(first.shared_state()), "own": ArrayRecord(first.state_dict())})
    fresh = build_method(name, bn_net(), C, ROUND_TRIP[name])
    fresh.load_shared_state(record["shared"].to_torch_state_dict())
    fresh.load_state_dict(record["own"].to_torch_state_dict())
    resumed = run(fresh, batches[5:])
    for a, b in zip(straight[5:], resumed):
        assert torch.equal(a, b)
    if name == "lcotta":
        assert fresh.last_info["projected"] == 1


@pytest.mark.parametrize("name", sorted(TTA_METHODS))
def test_same_seed_same_results(name):
    p = ROUND_TRIP.get(name, {})
    a = run(build_method(name, bn_net(seed=3), C, p), stream(8))
    b = run(build_method(name, bn_net(seed=3), C, p), stream(8))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", GRAD_METHODS)
def test_reset_restores_source(name):
    m = build_method(name, bn_net(), C, ROUND_TRIP[name])
    source_model = copy.deepcopy(m.model.state_dict())
    fresh_state = m.state_dict()
    first = run(m, stream(6))
    m.reset()
    for k, v in m.model.state_dict().items():
        assert torch.equal(v, source_model[k]), k
    assert {k: v.tolist() for k, v in m.state_dict().items()} == {k: v.tolist() for k, v in fresh_state.items()}
    again = run(m, stream(6))
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_load_empty_state_is_fresh_method_state():
    m = build_method("lcotta", bn_net(), C, ROUND_TRIP["lcotta"])
    run(m, stream(4))
    m.load_state_dict({})
    assert len(m.window) == 0 and m.batch_num == 0 and m.ema_probs is None and not m.optimizer.state


def test_eata_fisher_option():
    src = stream(3, seed=7)
    eta = build_method("eata", bn_net(), C, {"lr": 0.1, **LOOSE})
    eata = build_method("eata", bn_net(), C, {"lr": 0.1, **LOOSE, "fisher_alpha": 50.0})
    eata.compute_fisher(src)
    assert all(torch.all(f >= 0) for f in eata.fisher.values()) and any(f.sum() > 0 for f in eata.fisher.values())
    a, b = stream(3)[:2]
    assert torch.equal(eta(a), eata(a))  # at the anchor the penalty has zero gradient: same first step
    eta(b)
    eata(b)
    pulled = [(p - q).abs().sum() for p, q in zip(eta.param_list, eata.param_list)]
    assert sum(pulled) > 0  # the penalty acted on the second step
    assert any(k.startswith("fisher.") for k in eata.state_dict())


# ------------------------------------------------------------------------------------- errors


def no_norm_net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, C))


@pytest.mark.parametrize(
    "call",
    [
        lambda: build_method("nope", bn_net(), C),
        lambda: make_params("tent", {"learning_rate": 0.1}),
        lambda: build_method("tent", bn_net(), C, {"lr": 0.0}),
        lambda: build_method("tent", bn_net(), C, {"momentum": 1.0}),
        lambda: build_method("tent", bn_net(), C, {"momentum": 0.0}),  # nesterov without momentum
        lambda: build_method("eata", bn_net(), C, {"on_empty": "maybe"}),
        lambda: build_method("eata", bn_net(), C, {"d_margin": 0.0}),
        lambda: build_method("rdumb", bn_net(), C, {"reset_after_num_updates": 0}),
        lambda: build_method("rdumb", bn_net(), C, {"base": "cotta"}),
        lambda: build_method("lcotta", bn_net(), C, {"rank": 20, "window": 10}),
        lambda: build_method("lcotta", bn_net(), C, {"rank": 30, "window": 100}),  # D = 24
        lambda: build_method("lcotta", bn_net(), C, {"snapshot_every": 0}),
        lambda: build_method("tent", bn_net(), 1),
        lambda: build_method("tent", no_norm_net(), C),
        lambda: TTA_METHODS["eata"](bn_net(), C, make_params("tent")),
        lambda: build_method("tent", bn_net(), C)(torch.randn(1, 1, 6, 6)),
        lambda: build_method("bn_adapt", bn_net(), C)(torch.randn(1, 1, 6, 6)),
        lambda: build_method("tent", bn_net(), C + 1)(torch.randn(4, 1, 6, 6)),
        lambda: build_method("eata", bn_net(), C, {"fisher_alpha": 1.0})(torch.randn(4, 1, 6, 6)),
        lambda: build_method("eata", bn_net(), C).load_state_dict({"window": torch.zeros(1)}),
        lambda: build_method("tent", bn_net(), C).load_shared_state({"1.weight": torch.ones(4)}),
        lambda: build_method("tent", bn_net(), C).load_shared_state(
            {**build_method("tent", bn_net(), C).shared_state(), "1.weight": torch.ones(3)}),
    ],
)
def test_bad_input_is_config_error(call):
    with pytest.raises(ConfigError):
        call()


def test_single_sample_is_fine_without_batchnorm():
    out = build_method("tent", ln_net(), C)(torch.randn(1, 1, 6, 6))
    assert out.shape == (1, C)
