"""Federated LoRA strategies: FedAvg-LoRA, FFA-LoRA, FLoRA, FedEx-LoRA and FedSVD.

FedSVD — Lee et al., "FedSVD: Adaptive Orthogonalization for Private Federated Learning with LoRA"
(NeurIPS 2025, arXiv 2505.12805; code ``seanie12/fed-svd``).  Clients train only B (A frozen, as
FFA-LoRA); the server averages B (sample-size weighted) and then refactorises every LoRA layer,
B·A = UΣVᵀ → A ← V_rᵀ, B ← U_rΣ_r, so A is re-orthonormalised each round while B·A is unchanged
(``misc/utils.py::reinit_lora``; here done for all layers at once by
:func:`fedsim.kernels.refactor_lora_state_dict`, exact and ~200× faster than the authors'
per-layer SVD of the formed product).  Period and warm-up as the authors' flags
(``--recalculate-svd-period``, ``--svd-warmup-steps``; defaults 1 and 0).

What the refactorisation does, as the authors coded it.  The rows of B·A lie in the row space of
A, so V_rᵀ spans the same row space: the first refactorisation replaces A by an orthonormal basis of
span(A₀), and every later one only rotates the factors, (A, B) → (RA, BRᵀ) with R = A_new Aᵀ
orthogonal (r×r).  The client's loss sees (A, B) only through B·A, so its gradient in B rotates
with B (∇_{BRᵀ} = ∇_B Rᵀ); SGD (also with momentum or weight decay, since a fresh optimiser is built each
round), L2 gradient clipping, DP-SGD's per-sample clipping (‖GRᵀ‖ = ‖G‖) and isotropic Gaussian
noise (ξRᵀ has ξ's law) all commute with the rotation, and so does the sample-weighted mean of B.
Hence with local SGD — the authors' setting, lr 0.5, no weight decay — FedSVD *is* FFA-LoRA
started from an orthonormalised A: identical B·A and head without DP, identical in distribution
under DP (``tests/strategies/test_fedsvd_equivalence.py`` pins both, and that refactoring every
round equals refactoring once).  What FedSVD changes relative to FFA-LoRA is A's scale: Kaiming-
uniform(a=√5) rows have norm ≈ 1/√3 and V_rᵀ's rows norm 1, so at one learning rate FedSVD takes
roughly 3× larger steps on B·A (one SGD step gives Δ(s·BA) = −η s² ∇_W AᵀA).  A comparison of the
two at the same lr measures that step-size difference; the control that isolates it is
``ffa_lora`` with ``strategy.params.orthonormalise_a=first_round`` (FedSVD's first refactorisation, then A frozen) or
``init`` (A orthonormalised before round 1).  The SVD is not a no-op only with a local optimiser
that is not rotation-invariant, such as Adam (``client.optimizer=adam``; its per-coordinate
normalisation does not commute with BRᵀ): ``experiments/reproduce/fedsvd_mechanism.yaml``.

Baselines, as the authors' code has them (``server.py``):

* ``fedavg_lora`` — clients train A and B, the server averages both;
* ``ffa_lora``   — FFA-LoRA (Sun et al., ICLR 2024): A frozen at its initialisation, B averaged;
* ``flora``      — FLoRA (Wang et al., NeurIPS 2024): the weighted stack of client adapters is
  folded into the base weight, W ← W + s·Σ_k p_k B_k A_k, then A is re-initialised (Kaiming-uniform,
  a=√5) and B set to 0 every round;
* ``fedex_lora`` — FedEx-LoRA (Singhal et al., 2024): A and B averaged, and the residual
  s·(Σ_k p_k B_k A_k − (Σ_k p_k B_k)(Σ_k p_k A_k)) folded into W so the global update is exact.

Deviations from the authors' code: averaging B directly equals the authors' "global B + weighted
mean of client deltas" because every client starts the round from the same B; the zero-singular-
value rows of A after refactorising a rank-deficient product (B = 0) are completed inside A's row
space instead of arbitrary unit vectors (B·A is identical; see the kernel's docstring).

The server keeps the whole global adapter state (LoRA A/B, the classifier head and the wrapped
base weights); clients receive what the strategy needs (base weights only for FLoRA and
FedEx-LoRA, whose W changes) and reply only with what they trained.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedsim.device import resolve_device
from fedsim.errors import ConfigError
from fedsim.kernels import refactor_lora_state_dict
from fedsim.registry import MODELS, STRATEGIES
from fedsim.seeding import derive_seed
from fedsim.contracts import wire as W
from fedsim.contracts.strategy import StrategyContext

A_SUFFIX, B_SUFFIX, BASE_SUFFIX = W.LORA_A_SUFFIX, W.LORA_B_SUFFIX, W.LORA_BASE_SUFFIX

StateDict = dict[str, torch.Tensor]


def lora_prefixes(keys: Iterable[str]) -> list[str]:
    """Module prefixes that carry a LoRA pair (``...query.`` for ``...query.lora_A.weight``)."""
    return sorted(k[: -len(A_SUFFIX)] for k in keys if k.endswith(A_SUFFIX))


def reply_weights(replies: list[Message], key: str) -> list[float]:
    w = [float(m.content["metrics"][key]) for m in replies]
    total = sum(w)
    return [x / total for x in w]


class LoraFedAvg(FedAvg):
    """Sample-size-weighted averaging of the LoRA factors clients train, merged into the global state.

    Subclasses change what clients train (``train_A``), what they receive (``send_base``) and what
    happens after averaging (:meth:`post_aggregate`).
    """

    whole_model_updates = False  # fedsim.contracts.strategy.WHOLE_MODEL_UPDATES

    train_A: bool = True
    send_base: bool = False

    def __init__(self, *, lora_scale: float, root_seed: int, device: str = "cpu", **kwargs) -> None:
        super().__init__(**kwargs)
        self.lora_scale = lora_scale
        self.root_seed = root_seed
        self.device = device  # engine.device: where the server's SVD refactorisation runs
        self.global_arrays: ArrayRecord | None = None

    # -- what goes out ---------------------------------------------------------------------------
    def _outgoing(self, arrays: ArrayRecord) -> ArrayRecord:
        if self.send_base:
            return arrays
        return ArrayRecord(array_dict={k: v for k, v in arrays.items() if not k.endswith(BASE_SUFFIX)})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.global_arrays = arrays
        if not lora_prefixes(arrays.keys()):
            raise ConfigError(f"strategy {type(self).__name__} needs a LoRA model (e.g. model.name=minilm_lora)")
        config = ConfigRecord({**dict(config), W.LORA_TRAIN_A: self.train_A, W.LORA_TRAIN_B: True})
        return super().configure_train(server_round, self._outgoing(arrays), config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return super().configure_evaluate(server_round, self._outgoing(arrays), config, grid)

    # -- what comes back -------------------------------------------------------------------------
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        agg, metrics = super().aggregate_train(server_round, replies)
        if agg is None or self.global_arrays is None:
            return agg, metrics
        valid = [m for m in replies if not m.has_error()]
        state = self.global_arrays.to_torch_state_dict()
        averaged = agg.to_torch_state_dict()
        state.update(averaged)
        state = self.post_aggregate(server_round, state, valid)
        return ArrayRecord(state), metrics

    def post_aggregate(self, server_round: int, state: StateDict, replies: list[Message]) -> StateDict:
        return state

    def client_factors(self, replies: list[Message], prefix: str) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
        """(weight, B_k, A_k) of each reply for one LoRA layer, in the canonical reply order."""
        weights = reply_weights(replies, self.weighted_by_key)
        out = []
        for w, msg in zip(weights, replies):
            arrays = msg.content["arrays"]
            out.append((w, torch.from_numpy(arrays[prefix + B_SUFFIX].numpy()),
                        torch.from_numpy(arrays[prefix + A_SUFFIX].numpy())))
        return out


class FedAvgLoRA(LoraFedAvg):
    """FedAvg on LoRA: clients train A and B; both are averaged."""


#: When FFA-LoRA orthonormalises A once in its own row space (``strategy.params.orthonormalise_a``).
ORTHONORMALISE_MODES = ("none", "init", "first_round")


def refactor_state(state: StateDict, device: str = "cpu") -> StateDict:
    """FedSVD's server step on every LoRA layer: B·A = UΣVᵀ → A ← V_rᵀ, B ← U_rΣ_r (B·A unchanged).

    A's new rows are an orthonormal basis of A's own row space (completed inside it where B·A is
    rank-deficient, e.g. B = 0), so the step never leaves span(A).  ``device`` (``engine.device``):
    where the batched kernel runs; off the CPU the LoRA factors go there and come back (the global
    state lives on the host, as Flower's records do).
    """
    where = resolve_device(device)
    if where.type == "cpu":
        return dict(refactor_lora_state_dict(state, a_suffix=A_SUFFIX, b_suffix=B_SUFFIX))
    factors = {k: v.to(where) for k, v in state.items() if k.endswith((A_SUFFIX, B_SUFFIX))}
    done = refactor_lora_state_dict(factors, a_suffix=A_SUFFIX, b_suffix=B_SUFFIX)
    return {**state, **{k: v.to("cpu") for k, v in done.items()}}


class FFALoRA(LoraFedAvg):
    """FFA-LoRA: A frozen at its initialisation, only B trained and averaged.

    ``orthonormalise_a`` is FedSVD's control: ``"init"`` replaces A by an orthonormal basis of its
    own row space before round 1 (B = 0 then, so the model is unchanged), ``"first_round"`` applies
    FedSVD's refactorisation once, after round 1's aggregation, exactly as FedSVD's first one;
    ``"none"`` (default) is the paper's FFA-LoRA.  Both keep B·A and span(A).
    """

    train_A = False

    def __init__(self, *, orthonormalise_a: str = "none", **kwargs) -> None:
        super().__init__(**kwargs)
        if orthonormalise_a not in ORTHONORMALISE_MODES:
            raise ConfigError(f"strategy.params.orthonormalise_a must be one of {', '.join(ORTHONORMALISE_MODES)}, "
                              f"got {orthonormalise_a!r}")
        self.orthonormalise_a = orthonormalise_a

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.orthonormalise_a == "init" and server_round == 1:
            arrays = ArrayRecord(refactor_state(arrays.to_torch_state_dict(), self.device))
        return super().configure_train(server_round, arrays, config, grid)

    def post_aggregate(self, server_round: int, state: StateDict, replies: list[Message]) -> StateDict:
        if self.orthonormalise_a == "first_round" and server_round == 1:
            return refactor_state(state, self.device)
        return state


class FedSVD(FFALoRA):
    """FFA-LoRA plus an SVD refactorisation of every B·A after aggregation (A re-orthonormalised).

    After the first refactorisation each later one is a rotation (RA, BRᵀ) that local SGD and
    DP-SGD commute with, so with SGD this equals ``FFALoRA(orthonormalise_a="first_round")``; see
    the module doc.  ``orthonormalise_a="init"`` also starts FedSVD from an orthonormal A₀.
    """

    def __init__(self, *, svd_period: int, svd_warmup: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.svd_period = svd_period
        self.svd_warmup = svd_warmup

    def refactor_due(self, server_round: int) -> bool:
        """As the authors' ``on_round_complete`` with 0-based rnd = server_round − 1."""
        return self.svd_period > 0 and server_round % self.svd_period == 0 and server_round > self.svd_warmup

    def post_aggregate(self, server_round: int, state: StateDict, replies: list[Message]) -> StateDict:
        if self.refactor_due(server_round):
            return refactor_state(state, self.device)
        return super().post_aggregate(server_round, state, replies)


class FLoRA(LoraFedAvg):
    """FLoRA: fold the weighted stack of client adapters into W, then restart the adapters."""

    send_base = True

    def post_aggregate(self, server_round: int, state: StateDict, replies: list[Message]) -> StateDict:
        gen = torch.Generator().manual_seed(derive_seed(self.root_seed, "flora-reinit", server_round))
        for prefix in lora_prefixes(state):
            delta = sum(w * (b.double() @ a.double()) for w, b, a in self.client_factors(replies, prefix))
            base = state[prefix + BASE_SUFFIX]
            state[prefix + BASE_SUFFIX] = (base.double() + self.lora_scale * delta).to(base.dtype)
            a = state[prefix + A_SUFFIX]
            bound = 1.0 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=√5) on a (r, in) weight
            state[prefix + A_SUFFIX] = (torch.rand(a.shape, generator=gen, dtype=torch.float64) * 2 - 1).mul(bound).to(a.dtype)
            state[prefix + B_SUFFIX] = torch.zeros_like(state[prefix + B_SUFFIX])
        return state


class FedExLoRA(LoraFedAvg):
    """FedEx-LoRA: average A and B and fold the averaging residual into W (exact aggregation)."""

    send_base = True

    def post_aggregate(self, server_round: int, state: StateDict, replies: list[Message]) -> StateDict:
        for prefix in lora_prefixes(state):
            factors = self.client_factors(replies, prefix)
            mean_of_products = sum(w * (b.double() @ a.double()) for w, b, a in factors)
            b_avg = sum(w * b.double() for w, b, _ in factors)
            a_avg = sum(w * a.double() for w, _, a in factors)
            residual = mean_of_products - b_avg @ a_avg
            base = state[prefix + BASE_SUFFIX]
            state[prefix + BASE_SUFFIX] = (base.double() + self.lora_scale * residual).to(base.dtype)
        return state


@dataclass
class FFALoRAParams:
    orthonormalise_a: str = "none"  # none | init | first_round: orthonormalise A once in its row space


@dataclass
class FedSVDParams(FFALoRAParams):
    svd_period: int = 1  # refactorise every this many rounds (0 = never: plain FFA-LoRA)
    svd_warmup: int = 0  # no refactorisation in the first rounds


def lora_scale(ctx: StrategyContext, strategy: str) -> float:
    cfg = ctx.cfg
    params = MODELS.params(cfg.model.name, cfg.model.params, "model.params")
    if not (hasattr(params, "alpha") and hasattr(params, "rank")):
        raise ConfigError(f"strategy {strategy!r} needs a LoRA model (model.name=minilm_lora), got {cfg.model.name!r}")
    return float(params.alpha) / float(params.rank)


def _common(ctx: StrategyContext, strategy: str) -> dict:
    return dict(lora_scale=lora_scale(ctx, strategy), root_seed=ctx.cfg.seed, device=ctx.cfg.engine.device,
                **ctx.fedavg_kwargs())


@STRATEGIES.register("fedavg_lora", summary="FedAvg on LoRA adapters: clients train A and B, both averaged")
def build_fedavg_lora(ctx: StrategyContext, params: None) -> FedAvgLoRA:
    return FedAvgLoRA(**_common(ctx, "fedavg_lora"))


@STRATEGIES.register("ffa_lora", params=FFALoRAParams,
                     summary="FFA-LoRA (Sun et al., 2024): A frozen, B trained and averaged")
def build_ffa_lora(ctx: StrategyContext, params: FFALoRAParams) -> FFALoRA:
    return FFALoRA(orthonormalise_a=params.orthonormalise_a, **_common(ctx, "ffa_lora"))


@STRATEGIES.register("fedsvd", params=FedSVDParams,
                     summary="FedSVD (Lee et al., NeurIPS 2025): FFA-LoRA + SVD re-orthonormalisation of A")
def build_fedsvd(ctx: StrategyContext, params: FedSVDParams) -> FedSVD:
    if params.svd_period < 0 or params.svd_warmup < 0:
        raise ConfigError("strategy.params.svd_period and svd_warmup must be >= 0")
    return FedSVD(svd_period=params.svd_period, svd_warmup=params.svd_warmup,
                  orthonormalise_a=params.orthonormalise_a, **_common(ctx, "fedsvd"))


@STRATEGIES.register("flora", summary="FLoRA (Wang et al., 2024): stack client adapters into W, restart them")
def build_flora(ctx: StrategyContext, params: None) -> FLoRA:
    return FLoRA(**_common(ctx, "flora"))


@STRATEGIES.register("fedex_lora", summary="FedEx-LoRA (Singhal et al., 2024): average A, B; fold the residual into W")
def build_fedex_lora(ctx: StrategyContext, params: None) -> FedExLoRA:
    return FedExLoRA(**_common(ctx, "fedex_lora"))
