"""Flower's own Message-API strategies (``flwr.serverapp.strategy``), registered for experiment YAML.

Registered (lower-case Flower names): ``fedavg``, and the stock strategies of :data:`STOCK`:
``fedadagrad``, ``fedadam``, ``fedyogi`` (server-side adaptive optimisers, Reddi et al., 2021),
``fedavgm`` (server momentum, Hsu et al., 2019), ``fedmedian`` (coordinate-wise median, Yin et al.,
2018), ``fedtrimmedavg`` (coordinate-wise trimmed mean, ibid.), ``krum`` and ``multikrum``
(Blanchard et al., 2017), ``bulyan`` (El Mhamdi et al., 2018) and ``qfedavg`` (Li et al., 2020).
``fedprox`` is registered by :mod:`strategies.fedprox`.

Params are derived from the Flower constructor's signature, not copied: every argument becomes a
typed field of the strategy's params dataclass (``strategy.params.<arg>``, Flower's default),
except

* the arguments fedsim sets from the experiment (:data:`FROM_EXPERIMENT`): the sampling arguments
  of :meth:`~fedsim.contracts.strategy.StrategyContext.fedavg_kwargs`, and the client learning
  rate (``client.lr``) that FedOpt's ``eta_l`` (only logged by Flower) and QFedAvg's
  ``client_learning_rate`` (its Lipschitz estimate ``L = 1/lr``) stand for;
* the wire keys (:data:`WIRE_KEYS`: the record names and the weight/loss keys that fedsim's learners
  write, see :mod:`fedsim.contracts.wire`): Flower's defaults are what the learners send;
* arguments that cannot come from YAML: callables (metric aggregation functions, Bulyan's
  ``selection_rule``) and other objects.

A strategy without a YAML-typed argument (``fedmedian``) takes no params.  Krum, MultiKrum and
Bulyan check ``num_malicious_nodes`` against the clients sampled per round before training starts
(a ``ConfigError`` naming the key and the fix), FedTrimmedAvg its ``beta``, and so on.

Strategies that keep state between rounds (FedOpt's moments ``m_t``/``v_t``, FedAvgM's momentum)
checkpoint it (:meth:`_Stock.checkpoint_state`), so a resumed run continues exactly.

Left out:

* ``FedXgbBagging`` and ``FedXgbCyclic``: they aggregate serialised XGBoost boosters (a JSON tree
  blob in one byte array), not the torch state dicts that fedsim's learners send; no learner here
  trains trees.
* The DP wrappers (``DifferentialPrivacy{Client,Server}Side{Fixed,Adaptive}Clipping``): fedsim has its
  own DP layer (:mod:`privacy`; ``privacy.level=client`` wraps the strategy itself).

Client-level DP (``privacy.level=client``) is refused for every stock strategy here: the wrapper
clips each update, lets the wrapped strategy aggregate and adds noise of std ``sigma*C/m``, which is
calibrated for the uniform mean of the clipped updates.  A median, trimmed mean, Krum, Bulyan or
the loss-weighted q-FedAvg mean has another sensitivity, and FedOpt/FedAvgM add the noise after the
server optimiser, whose state is built from the un-noised mean.  QFedAvg is refused under any DP
level: it weights updates by each client's train loss, which no DP mechanism here covers.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from typing import Any, Callable, Optional

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import FedAvg

from fedsim.contracts.strategy import StrategyContext
from fedsim.errors import ConfigError
from fedsim.heap import frozen_heap
from fedsim.registry import STRATEGIES


@STRATEGIES.register("fedavg", summary="Flower's FedAvg (McMahan et al., 2017), sample-size weighted")
def build_fedavg(ctx: StrategyContext, params: None) -> FedAvg:
    return FedAvg(**ctx.fedavg_kwargs())


# -- which constructor arguments become params --------------------------------------------------
#: Arguments fedsim sets from the experiment (the sampling of ``StrategyContext.fedavg_kwargs``
#: and the client learning rate, ``client.lr``).
FROM_EXPERIMENT: frozenset[str] = frozenset({
    "fraction_train", "fraction_evaluate", "min_train_nodes", "min_evaluate_nodes", "min_available_nodes",
    "eta_l", "client_learning_rate",
})
#: Wire keys: the names fedsim's learners write; Flower's defaults match them.
WIRE_KEYS: frozenset[str] = frozenset({"weighted_by_key", "arrayrecord_key", "configrecord_key", "train_loss_key"})
#: Types a YAML value can have.
YAML_TYPES: tuple[type, ...] = (bool, int, float, str)


def _yaml_type(annotation: Any) -> Any:
    """``annotation`` if a YAML scalar type (or an Optional of one), else None."""
    if annotation in YAML_TYPES:
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and args[0] in YAML_TYPES and type(None) in typing.get_args(annotation):
        return Optional[args[0]]
    return None


def yaml_arguments(cls: type) -> list[tuple[str, Any, Any]]:
    """``(name, type, default)`` of each constructor argument of ``cls`` that YAML sets."""
    hints = typing.get_type_hints(cls.__init__)
    out = []
    for p in inspect.signature(cls).parameters.values():
        if p.name in FROM_EXPERIMENT or p.name in WIRE_KEYS or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        tp = _yaml_type(hints.get(p.name, p.annotation))
        if tp is None:  # a callable or another object: not from YAML
            continue
        if p.default is p.empty:
            raise TypeError(f"{cls.__name__}({p.name}) has no default and fedsim does not set it")
        out.append((p.name, tp, p.default))
    return out


def params_dataclass(cls: type) -> type | None:
    """The params dataclass of ``cls``: one typed field per YAML argument, with Flower's default."""
    fields = [(name, tp, dataclasses.field(default=default)) for name, tp, default in yaml_arguments(cls)]
    if not fields:
        return None
    name = f"{cls.__name__}Params"
    made = dataclasses.make_dataclass(name, fields)
    made.__module__ = __name__
    setattr(sys.modules[__name__], name, made)  # importable by name (pickling)
    return made


# -- checkpointing of state kept between rounds -------------------------------------------------
#: NumPy values a strategy keeps (arithmetic on a 0-d array gives a NumPy scalar, e.g. FedOpt's ``m_t``).
_NUMPY = (np.ndarray, np.generic)


class _Stock:
    """What fedsim adds to a stock Flower strategy (mixed in before it):

    * checkpoints of every array-valued attribute (see :mod:`fedsim.engine.checkpoint`): ArrayRecords,
      ``dict[str, ndarray]`` (FedOpt's ``m_t``/``v_t``) and ``list[ndarray]`` (FedAvgM's momentum);
    * aggregation under ``gc.freeze()``: Flower's ``ArrayRecord.to_numpy_ndarrays(keep_input=False)``
      (Bulyan, QFedAvg: once per reply) forces a full ``gc.collect()``, which scans every object of
      the process (~0.7 s with torch and MLflow loaded); frozen, it scans only the round's new objects.

    None of them returns the plain mean of the replies, so none declares ``mean_aggregation``
    (client-level DP refuses them: :mod:`privacy.client_level`).
    """

    mean_aggregation = False

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        with frozen_heap():  # already frozen inside fedsim's round loop; this covers direct callers
            return super().aggregate_train(server_round, replies)  # type: ignore[misc]

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for attr, value in vars(self).items():
            if isinstance(value, ArrayRecord):
                state.update({f"{attr}:record/{k}": v for k, v in value.to_torch_state_dict().items()})
            elif isinstance(value, dict) and value and all(isinstance(v, _NUMPY) for v in value.values()):
                state.update({f"{attr}:dict/{k}": torch.from_numpy(np.array(v, order="C")) for k, v in value.items()})
            elif isinstance(value, list) and value and all(isinstance(v, _NUMPY) for v in value):
                state.update({f"{attr}:list/{i}": torch.from_numpy(np.array(v, order="C"))
                              for i, v in enumerate(value)})
        return state

    def restore_state(self, state: dict[str, torch.Tensor]) -> None:
        by_attr: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            head, name = key.split("/", 1)
            attr, kind = head.rsplit(":", 1)
            by_attr.setdefault((attr, kind), {})[name] = value
        for (attr, kind), tensors in by_attr.items():
            if kind == "record":
                setattr(self, attr, ArrayRecord(tensors))
            elif kind == "dict":
                setattr(self, attr, {k: v.numpy().copy() for k, v in tensors.items()})
            else:
                setattr(self, attr, [tensors[i].numpy().copy() for i in sorted(tensors, key=int)])


# -- checks against the experiment ---------------------------------------------------------------
def _fail(key: str, value: Any, why: str, fix: str) -> None:
    raise ConfigError(f"strategy.params.{key}={value} {why}; {fix}")


def _check_range(params: Any, key: str, ok: Callable[[float], bool], text: str) -> None:
    value = getattr(params, key)
    if not ok(value):
        _fail(key, value, f"must be {text}", f"set strategy.params.{key} {text}")


def _cohort(ctx: StrategyContext) -> str:
    return f"{ctx.train_sample_size} clients sampled per round (num_clients * strategy.fraction_train)"


def _check_fedopt(ctx: StrategyContext, p: Any) -> None:
    _check_range(p, "eta", lambda v: v > 0, "> 0")
    _check_range(p, "tau", lambda v: v > 0, "> 0")
    for key in ("beta_1", "beta_2"):
        if hasattr(p, key):
            _check_range(p, key, lambda v: 0 <= v < 1, "in [0, 1)")


def _check_fedavgm(ctx: StrategyContext, p: Any) -> None:
    _check_range(p, "server_learning_rate", lambda v: v > 0, "> 0")
    _check_range(p, "server_momentum", lambda v: 0 <= v < 1, "in [0, 1)")


def _check_trimmed(ctx: StrategyContext, p: Any) -> None:
    _check_range(p, "beta", lambda v: 0 <= v < 0.5, "in [0, 0.5)")


def _check_tolerated(ctx: StrategyContext, p: Any, k: int, rule: str) -> None:
    """``num_malicious_nodes`` f >= 0 and a cohort of at least k·f+3 clients per round."""
    f, n = p.num_malicious_nodes, ctx.train_sample_size
    _check_range(p, "num_malicious_nodes", lambda v: v >= 0, ">= 0")
    if n < k * f + 3:
        _fail("num_malicious_nodes", f, f"needs at least {k}f+3 = {k * f + 3} clients per round ({rule}), but the "
              f"experiment has {_cohort(ctx)}", "lower it or raise num_clients / strategy.fraction_train")


def _check_krum(ctx: StrategyContext, p: Any) -> None:
    _check_tolerated(ctx, p, 2, "Krum: n > 2f+2")
    f, n = p.num_malicious_nodes, ctx.train_sample_size
    if hasattr(p, "num_nodes_to_select") and not 1 <= p.num_nodes_to_select <= n - f:
        _fail("num_nodes_to_select", p.num_nodes_to_select, f"must be in 1..n-f = 1..{n - f} with {_cohort(ctx)} "
              f"and num_malicious_nodes={f}", "set strategy.params.num_nodes_to_select in that range")


def _check_bulyan(ctx: StrategyContext, p: Any) -> None:
    _check_tolerated(ctx, p, 4, "Bulyan")


def _check_qfedavg(ctx: StrategyContext, p: Any) -> None:
    _check_range(p, "q", lambda v: v >= 0, ">= 0")
    if ctx.cfg.privacy.enabled:
        raise ConfigError("strategy.name=qfedavg weights each update by the client's train loss, which DP does not "
                          "cover; set privacy.enabled=false or use another strategy")


@dataclasses.dataclass(frozen=True)
class Stock:
    """One stock Flower strategy: its class, summary, checks and the arguments fedsim derives."""

    cls: type
    summary: str
    check: Callable[[StrategyContext, Any], None] | None = None
    #: constructor arguments from the experiment beyond ``fedavg_kwargs`` (name -> ctx -> value)
    derived: dict[str, Callable[[StrategyContext], Any]] = dataclasses.field(default_factory=dict)
    #: the fewest replies it can aggregate, from its params (fedsim.contracts.strategy.MIN_REPLIES)
    min_replies: Callable[[Any], int] | None = None


_CLIENT_LR = {"eta_l": lambda ctx: ctx.cfg.client.lr}

#: The registered stock strategies, by registry name.
STOCK: dict[str, Stock] = {
    "fedadagrad": Stock(flwr_strategy.FedAdagrad, "Flower's FedAdagrad (Reddi et al., 2021): adaptive server optimiser",
                        _check_fedopt, _CLIENT_LR),
    "fedadam": Stock(flwr_strategy.FedAdam, "Flower's FedAdam (Reddi et al., 2021): Adam on the server",
                     _check_fedopt, _CLIENT_LR),
    "fedyogi": Stock(flwr_strategy.FedYogi, "Flower's FedYogi (Reddi et al., 2021): Yogi on the server",
                     _check_fedopt, _CLIENT_LR),
    "fedavgm": Stock(flwr_strategy.FedAvgM, "Flower's FedAvgM (Hsu et al., 2019): FedAvg with server momentum",
                     _check_fedavgm),
    "fedmedian": Stock(flwr_strategy.FedMedian, "Flower's FedMedian (Yin et al., 2018): coordinate-wise median"),
    "fedtrimmedavg": Stock(flwr_strategy.FedTrimmedAvg,
                           "Flower's FedTrimmedAvg (Yin et al., 2018): coordinate-wise trimmed mean", _check_trimmed),
    "krum": Stock(flwr_strategy.Krum, "Flower's Krum (Blanchard et al., 2017): the update closest to its n-f-2 "
                  "neighbours", _check_krum),
    "multikrum": Stock(flwr_strategy.MultiKrum, "Flower's MultiKrum (Blanchard et al., 2017): FedAvg of the m best "
                       "Krum scores", _check_krum),
    "bulyan": Stock(flwr_strategy.Bulyan, "Flower's Bulyan (El Mhamdi et al., 2018): MultiKrum selection, then a "
                    "coordinate-wise mean around the median", _check_bulyan,
                    min_replies=lambda p: 4 * p.num_malicious_nodes + 3),
    "qfedavg": Stock(flwr_strategy.QFedAvg, "Flower's q-FedAvg (Li et al., 2020): loss-weighted fair aggregation",
                     _check_qfedavg, {"client_learning_rate": lambda ctx: ctx.cfg.client.lr}),
}


def _with_fedsim(cls: type) -> type:
    """``cls`` with :class:`_Stock` mixed in (same name, so logs read as Flower's)."""
    sub = type(cls.__name__, (_Stock, cls),
               {"__module__": __name__, "__qualname__": f"Stock{cls.__name__}", "__doc__": cls.__doc__})
    setattr(sys.modules[__name__], sub.__qualname__, sub)  # importable by name (pickling)
    return sub


def _register(name: str, stock: Stock) -> None:
    cls = _with_fedsim(stock.cls)
    params_cls = params_dataclass(stock.cls)

    def build(ctx: StrategyContext, params: Any) -> Any:
        if stock.check is not None:
            stock.check(ctx, params)
        kwargs = {**ctx.fedavg_kwargs(), **{k: f(ctx) for k, f in stock.derived.items()},
                  **(dataclasses.asdict(params) if params is not None else {})}
        try:
            strategy = cls(**kwargs)
        except ValueError as exc:  # Flower's own checks (e.g. FedTrimmedAvg's beta)
            raise ConfigError(f"strategy.params ({name}): {str(exc).splitlines()[0]}") from None
        if stock.min_replies is not None:
            strategy.min_replies = stock.min_replies(params)
        return strategy

    build.__name__ = build.__qualname__ = f"build_{name}"
    build.__doc__ = stock.summary
    STRATEGIES.register(name, params=params_cls, summary=stock.summary)(build)


for _name, _stock in STOCK.items():
    _register(_name, _stock)
