"""FedSVD's mechanism, pinned: after the first refactorisation every later SVD only rotates the
factors, (A, B) → (RA, BRᵀ), and SGD / DP-SGD commute with that rotation, so FedSVD equals FFA-LoRA
with A orthonormalised once (``strategy.params.orthonormalise_a``); Adam does not commute with it.

The runs are real ``run_experiment`` runs (local engine, supervised learner, Opacus under DP) on a
tiny LoRA MLP over the 8×8 digits, registered here as a test-only model, so a run takes a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from opacus.optimizers import optimizer as opacus_optimizer
from torch import nn

from fedsim import config as C
from fedsim.errors import ConfigError
from fedsim.engine.runtime import RunSpec, drop_learners
from fedsim.engine.server import build_strategy
from fedsim.models.minilm import LoRALinear, MiniLMLoRAClassifier
from fedsim.registry import MODELS
from fedsim.runner import RunSummary, run_experiment
from strategies.lora import A_SUFFIX, B_SUFFIX, FedSVD, FFALoRA, lora_prefixes, refactor_state
from tests.strategies.util import rows_without

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_MODEL = "test_tiny_lora"


@dataclass
class TinyLoRAParams:
    """An MLP with LoRA (rank 4, scale alpha/rank = 1) on every hidden layer."""

    rank: int = 4
    alpha: float = 4.0
    hidden: list[int] = field(default_factory=lambda: [12, 12])
    train_A: bool = True
    train_head: bool = True


class TinyLoRA(nn.Module):
    """The hooks the supervised learner and the LoRA strategies use, as ``minilm_lora`` has them."""

    def __init__(self, params: TinyLoRAParams, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.params = params
        widths = [in_features, *params.hidden]
        self.layers = nn.ModuleList(LoRALinear(nn.Linear(i, o), params.rank, params.alpha)
                                    for i, o in zip(widths, widths[1:]))
        self.classifier = nn.Linear(widths[-1], num_classes)
        self.set_trainable(A=params.train_A, B=True, head=params.train_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.classifier(x)

    def lora_layers(self) -> dict[str, LoRALinear]:
        return {f"layers.{i}": layer for i, layer in enumerate(self.layers)}

    def federated_keys(self, include_base: bool = False) -> list[str]:
        wanted = {f"{p}.lora_{f}.weight" for p in self.lora_layers() for f in "AB"} | {"classifier.weight",
                                                                                        "classifier.bias"}
        if include_base:
            wanted |= {f"{p}.base_layer.weight" for p in self.lora_layers()}
        return [k for k in self.state_dict() if k in wanted]

    # the same hooks as minilm_lora, not copies of them
    set_trainable = MiniLMLoRAClassifier.set_trainable
    trainable_keys = MiniLMLoRAClassifier.trainable_keys


if TINY_MODEL not in MODELS._entries:  # registered once per session, never shadowing a real model
    @MODELS.register(TINY_MODEL, params=TinyLoRAParams, summary="test-only LoRA MLP")
    def build_tiny_lora(params: TinyLoRAParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return TinyLoRA(params, math.prod(input_shape), num_classes)


def cfg(strategy: str, *overrides: str, rounds: int = 4, dp: bool = False) -> C.ExperimentConfig:
    """FedSVD's setting in miniature: digits, 4 clients, 2 per round, 5 local SGD steps, head trained."""
    base = [f"model.name={TINY_MODEL}", "model.params={hidden: [12, 12]}", "data.partition.name=iid",
            "client.local_steps=5", "client.batch_size=32", "client.optimizer=sgd", "client.lr=0.5",
            "strategy.fraction_train=0.5", "strategy.fraction_evaluate=0.0", f"strategy.name={strategy}"]
    if dp:
        base += ["privacy.enabled=true", "privacy.epsilon=3.0", "privacy.max_grad_norm=1.0",
                 "privacy.max_physical_batch_size=64"]
    c = C.load_config("fedavg_digits", [*base, *overrides], {"rounds": rounds, "clients": 4})
    c.tracking.enabled = False
    return c


def run(strategy: str, *overrides: str, **kw) -> RunSummary:
    return run_experiment(cfg(strategy, *overrides, **kw))


def products(arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """B·A of every LoRA layer, in float64."""
    return {p: arrays[p + B_SUFFIX].double() @ arrays[p + A_SUFFIX].double() for p in lora_prefixes(arrays)}


def rel_diff(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    """Largest ‖x − y‖ / ‖y‖ over the keys."""
    return max(float((x[k].double() - y[k].double()).norm() / y[k].double().norm()) for k in y)


def head(arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: arrays[k] for k in ("classifier.weight", "classifier.bias")}


def assert_same_history(a: RunSummary, b: RunSummary, rel: float = 1e-4) -> None:
    rows_a, rows_b = (rows_without(r.history.as_rows(), "privacy/") for r in (a, b))
    assert len(rows_a) == len(rows_b)
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=1e-6), k


def is_orthonormal(a: torch.Tensor, tol: float = 1e-5) -> bool:
    a = a.double()
    return bool((a @ a.T - torch.eye(a.shape[0], dtype=torch.float64)).abs().max() <= tol)


# -- the server step: one refactorisation of an orthonormal A is a rotation ------------------------

def test_refactoring_an_orthonormal_a_only_rotates_the_factors() -> None:
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(20, 4, generator=g, dtype=torch.float64))
    state = {"x." + A_SUFFIX: q.T.contiguous(), "x." + B_SUFFIX: torch.randn(9, 4, generator=g, dtype=torch.float64)}
    out = refactor_state(state)
    a, b, a_new, b_new = state["x." + A_SUFFIX], state["x." + B_SUFFIX], out["x." + A_SUFFIX], out["x." + B_SUFFIX]
    rot = a_new @ a.T  # r×r
    torch.testing.assert_close(rot @ rot.T, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(a_new, rot @ a, rtol=0, atol=1e-10)  # A ← RA: the row space is kept
    torch.testing.assert_close(b_new, b @ rot.T, rtol=0, atol=1e-10)  # B ← BRᵀ
    assert not torch.allclose(rot, torch.eye(4, dtype=torch.float64), atol=1e-3)  # and it is not a no-op


def test_orthonormalise_a_modes_keep_the_product_and_the_row_space() -> None:
    g = torch.Generator().manual_seed(1)
    a0 = torch.rand(4, 20, generator=g) * 2 - 1
    state = {"x." + A_SUFFIX: a0, "x." + B_SUFFIX: torch.zeros(9, 4), "head.weight": torch.randn(3, 9, generator=g)}
    kwargs = dict(lora_scale=1.0, root_seed=0, min_train_nodes=1, min_evaluate_nodes=0, min_available_nodes=1)
    first = FFALoRA(orthonormalise_a="first_round", **kwargs)
    trained = dict(state, **{"x." + B_SUFFIX: torch.randn(9, 4, generator=g)})
    for rnd, expect_changed in ((1, True), (2, False)):  # once, after round 1 only
        out = first.post_aggregate(rnd, dict(trained), [])
        assert (not torch.equal(out["x." + A_SUFFIX], a0)) == expect_changed
        torch.testing.assert_close(products(out), products(trained), rtol=1e-5, atol=1e-6)
    out = first.post_aggregate(1, dict(trained), [])
    assert is_orthonormal(out["x." + A_SUFFIX]) and torch.equal(out["head.weight"], state["head.weight"])
    proj = a0.double().T @ torch.linalg.pinv(a0.double().T)  # projector onto span(A₀ rows)
    torch.testing.assert_close(out["x." + A_SUFFIX].double() @ proj, out["x." + A_SUFFIX].double(), atol=1e-5, rtol=0)
    assert FFALoRA(**kwargs).post_aggregate(1, dict(trained), []) == trained  # default: plain FFA-LoRA
    with pytest.raises(ConfigError, match="orthonormalise_a"):
        FFALoRA(orthonormalise_a="always", **kwargs)
    assert FedSVD(svd_period=1, svd_warmup=0, **kwargs).orthonormalise_a == "none"


def test_orthonormalise_a_is_a_typed_strategy_param() -> None:
    s = build_strategy(RunSpec.from_config(cfg("ffa_lora", "strategy.params.orthonormalise_a=first_round")))
    assert type(s) is FFALoRA and s.orthonormalise_a == "first_round"
    assert build_strategy(RunSpec.from_config(cfg("ffa_lora"))).orthonormalise_a == "none"
    s = build_strategy(RunSpec.from_config(cfg("fedsvd", "strategy.params.orthonormalise_a=init")))
    assert type(s) is FedSVD and s.orthonormalise_a == "init" and s.svd_period == 1
    with pytest.raises(ConfigError, match="orthonormalise_a"):
        build_strategy(RunSpec.from_config(cfg("ffa_lora", "strategy.params.orthonormalise_a=yes")))
    with pytest.raises(ConfigError, match="strategy.params"):
        build_strategy(RunSpec.from_config(cfg("ffa_lora", "strategy.params.svd_period=2")))


# -- whole runs: FedSVD ≡ FFA-LoRA with A orthonormalised once -------------------------------------

@pytest.fixture(scope="module")
def sgd_runs() -> dict[str, RunSummary]:
    return {"fedsvd": run("fedsvd"),
            "ffa_first": run("ffa_lora", "strategy.params.orthonormalise_a=first_round"),
            "ffa": run("ffa_lora")}


def test_fedsvd_equals_ffa_lora_orthonormalised_after_round_one(sgd_runs) -> None:
    svd, ffa = sgd_runs["fedsvd"].final_arrays, sgd_runs["ffa_first"].final_arrays
    assert rel_diff(products(svd), products(ffa)) < 1e-4
    torch.testing.assert_close(head(svd), head(ffa), rtol=1e-4, atol=1e-5)
    assert_same_history(sgd_runs["fedsvd"], sgd_runs["ffa_first"])
    for p in lora_prefixes(svd):  # the factors differ (FedSVD kept rotating them) but span the same rows
        a_svd, a_ffa = svd[p + A_SUFFIX].double(), ffa[p + A_SUFFIX].double()
        assert is_orthonormal(a_svd) and is_orthonormal(a_ffa)
        rot = a_svd @ a_ffa.T
        torch.testing.assert_close(rot @ rot.T, torch.eye(rot.shape[0], dtype=torch.float64), atol=1e-5, rtol=0)
        assert not torch.allclose(a_svd, a_ffa, atol=1e-3)
    # the control is needed: plain FFA-LoRA (A₀ rows of norm ≈ 1/√3) is another trajectory
    assert rel_diff(products(sgd_runs["ffa"].final_arrays), products(svd)) > 0.05


def test_from_the_same_orthonormal_a0_fedsvd_and_ffa_lora_agree() -> None:
    svd = run("fedsvd", "strategy.params.orthonormalise_a=init", rounds=3)
    ffa = run("ffa_lora", "strategy.params.orthonormalise_a=init", rounds=3)
    assert rel_diff(products(svd.final_arrays), products(ffa.final_arrays)) < 1e-4
    torch.testing.assert_close(head(svd.final_arrays), head(ffa.final_arrays), rtol=1e-4, atol=1e-5)
    assert_same_history(svd, ffa)
    a0 = {p: ffa.final_arrays[p + A_SUFFIX] for p in lora_prefixes(ffa.final_arrays)}
    assert all(is_orthonormal(a) for a in a0.values())  # FFA-LoRA's A: orthonormalised once, then frozen


def test_refactoring_every_round_equals_refactoring_once(sgd_runs) -> None:
    # first refactorisation after round 3 in both; then again after round 4, or never again
    every = run("fedsvd", "strategy.params.svd_period=1", "strategy.params.svd_warmup=2", rounds=4)
    once = run("fedsvd", "strategy.params.svd_period=3", rounds=4)
    assert rel_diff(products(every.final_arrays), products(once.final_arrays)) < 1e-4
    torch.testing.assert_close(head(every.final_arrays), head(once.final_arrays), rtol=1e-4, atol=1e-5)
    assert_same_history(every, once)
    # but when the first refactorisation happens matters (step size before it): not FedSVD's default
    assert rel_diff(products(every.final_arrays), products(sgd_runs["fedsvd"].final_arrays)) > 0.01


# -- DP-SGD: equal in distribution, shown exactly by rotating the noise draw ------------------------

def rotation_equivariant_add_noise(self: opacus_optimizer.DPOptimizer) -> None:
    """Opacus' ``add_noise``, except that a LoRA B's noise is ζ·Aᵀ with ζ an isotropic (m × n) draw.

    For A with orthonormal rows ζAᵀ is isotropic N(0, σ²C²) on (m × r), the law Opacus draws, so the
    mechanism (and the ledger) is unchanged; and A → RA turns the draw into ζAᵀRᵀ: the rotated draw.
    """
    std = self.noise_multiplier * self.max_grad_norm
    for p in self.params:
        opacus_optimizer._check_processed_flag(p.summed_grad)
        a = getattr(p, "_lora_A", None)
        if a is None:
            noise = opacus_optimizer._generate_noise(std=std, reference=p.summed_grad, generator=self.generator)
        else:
            zeta = torch.normal(0.0, std, (p.shape[0], a.shape[1]), generator=self.generator)
            noise = zeta @ a.detach().T
        p.grad = (p.summed_grad + noise).view_as(p)
        opacus_optimizer._mark_as_processed(p.summed_grad)


@pytest.fixture
def rotated_noise(monkeypatch):
    """Tag each tiny model's B weights with their A and route Opacus' noise through the patch above."""
    original_init = TinyLoRA.__init__

    def init(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        for layer in self.lora_layers().values():
            layer.lora_B.weight._lora_A = layer.lora_A.weight

    drop_learners()  # no resident model built before the patch
    monkeypatch.setattr(TinyLoRA, "__init__", init)
    monkeypatch.setattr(opacus_optimizer.DPOptimizer, "add_noise", rotation_equivariant_add_noise)
    yield
    drop_learners()


def test_under_dp_the_rotated_noise_draw_gives_the_rotated_update(rotated_noise) -> None:
    svd = run("fedsvd", dp=True, rounds=3)
    ffa = run("ffa_lora", "strategy.params.orthonormalise_a=first_round", dp=True, rounds=3)
    assert svd.history.as_rows()[-1]["privacy/epsilon_max"] <= 3.0  # a DP run under the ledger
    assert rel_diff(products(svd.final_arrays), products(ffa.final_arrays)) < 1e-4
    torch.testing.assert_close(head(svd.final_arrays), head(ffa.final_arrays), rtol=1e-4, atol=1e-5)
    assert_same_history(svd, ffa)
    assert rows_without(svd.history.as_rows(), "train/", "eval/") == rows_without(ffa.history.as_rows(), "train/",
                                                                                   "eval/")  # same ledger


def test_under_dp_opacus_own_noise_draws_differ_but_not_in_law() -> None:
    """Without the rotated draw the two runs are different samples of the same law (same ledger)."""
    svd = run("fedsvd", dp=True, rounds=3)
    ffa = run("ffa_lora", "strategy.params.orthonormalise_a=first_round", dp=True, rounds=3)
    assert rel_diff(products(svd.final_arrays), products(ffa.final_arrays)) > 1e-3
    privacy = [{k: v for k, v in r.items() if k.startswith("privacy/")} for r in svd.history.as_rows()]
    assert privacy == [{k: v for k, v in r.items() if k.startswith("privacy/")} for r in ffa.history.as_rows()]


# -- Adam: not rotation-invariant, so there the SVD is not a no-op ---------------------------------

def test_with_adam_fedsvd_and_the_control_differ() -> None:
    adam = ("client.optimizer=adam", "client.lr=0.01")
    svd = run("fedsvd", *adam, rounds=3)
    ffa = run("ffa_lora", "strategy.params.orthonormalise_a=first_round", *adam, rounds=3)
    assert rel_diff(products(svd.final_arrays), products(ffa.final_arrays)) > 0.02
    losses = [r["train/loss"] for r in svd.history.as_rows()[1:]], [r["train/loss"] for r in ffa.history.as_rows()[1:]]
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)  # round 1: same state, same steps
    assert losses[0][-1] != pytest.approx(losses[1][-1], rel=1e-5)  # then the rotation changes Adam's steps
