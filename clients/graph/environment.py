"""What an ``imgda`` run is built from: its settings, its graphs and node views, its network, and
each node's role in the federation.

:class:`GraphEnvironment` builds the source/target graphs (:mod:`envs.graphs`), the node views
(:func:`clients.graph.task.build_task`) and the network (:class:`clients.graph.model.GraphNet`) on
first use, so that importing it (and registering the learner) stays cheap: the PyG-based modules
load only then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from clients.graph.baselines import METHODS, MethodSpec
from envs.graphs import CSBMParams, GraphDomains, citation_domains, csbm_domains
from fedsim.config import ExperimentConfig
from fedsim.contracts.learner import StateDict
from fedsim.errors import ConfigError
from fedsim.seeding import derive_seed

if TYPE_CHECKING:
    from clients.graph.model import GraphNet
    from clients.graph.task import GraphTask

__all__ = ["GraphDAParams", "GraphEnvironment", "PROTO_COUNT", "PROTO_SUM", "SELECTIONS", "global_prototypes"]

log = logging.getLogger("fedsim")

PROTO_SUM, PROTO_COUNT = "proto.sum", "proto.count"
SELECTIONS = ("source_val", "target_test")


@dataclass
class GraphDAParams:
    """``client.params`` of the ``imgda`` learner."""

    method: str = "imgda"  # imgda | imgda_no_cb | imgda_no_cd | imgda_fixed_tau | source | balanced | dann | udagcn
    imbalance: float = 20.0  # rho = n_max / n_min of the long-tailed source training graph
    dataset: str = "csbm"  # csbm | citation (the authors' {name}.docs/edgelist/labels.txt files)
    graph: CSBMParams = field(default_factory=CSBMParams)
    citation_root: str = ""
    citation_source: str = "ACMv9"
    citation_target: str = "Citationv1"
    # optimisation (the authors': Adam lr 0.01, weight decay 1e-3, dropout 0.1, 200 epochs)
    epochs_per_round: int = 10
    lr: float = 0.01
    weight_decay: float = 1e-3
    hidden: int = 64
    dropout: float = 0.1
    keep_optimizer_state: bool = True  # Adam moments persist across rounds (node-local)
    # ImGDA
    anchors: int = 40  # k, anchors per class and branch
    tau0: float = 0.5  # dynamic temperature floor
    fixed_tau: float = 1.0  # the temperature of imgda_fixed_tau
    temperature_counts: str = "longtail"  # longtail | original (the authors' whole-original-graph counts)
    cd_temperature: float = 1.0
    cd_denominator: str = "class"  # class (as coded) | all
    w_cb: float = 1.0
    w_cd: float = 1.0
    w_domain: float = 1.0
    walks: int = 40  # PPMI random walks per node
    path_len: int = 5
    ppmi_clip: bool = True  # clip PMI at 0 (PPMI proper); false = the authors' code (negative PMI kept)
    # evaluation
    infer: str = "method"  # method (the method's own) | local | global: the branch the classifier predicts from
    selection: str = "source_val"  # source_val | target_test (the authors' optimistic protocol)
    tail_classes: int = 2  # the smallest this-many classes of the source are the tail
    # federated variant
    client_order: str = "rotate"  # rotate | same: each source client's head-to-tail class order
    share_prototypes: bool = True  # source clients contrast with the global prototypes in L_cb
    target_weight: float = 1.0  # the target node's FedAvg weight, in average source nodes


def global_prototypes(arrays: StateDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(local ``[K, d]``, global ``[K, d]``, classes ``[K]``) of the classes the federation has seen."""
    if PROTO_COUNT not in arrays:
        return None
    counts, sums = arrays[PROTO_COUNT], arrays[PROTO_SUM]
    seen = torch.nonzero(counts > 0).view(-1)
    if len(seen) == 0:
        return None
    mean = sums[:, seen] / counts[seen].view(1, -1, 1)
    return mean[0], mean[1], seen


class GraphEnvironment:
    """The method, graphs, node views and network of one ``imgda`` run, built on first use."""

    def __init__(self, cfg: ExperimentConfig, params: GraphDAParams) -> None:
        self.cfg, self.params = cfg, params
        self._task: GraphTask | None = None
        self._net: GraphNet | None = None

    @property
    def spec(self) -> MethodSpec:
        """The method's spec, with ``infer`` overridden unless it is ``method``."""
        try:
            spec = METHODS[self.params.method]
        except KeyError:
            raise ConfigError(f"unknown imgda method {self.params.method!r}; choose one of "
                              f"{', '.join(METHODS)}") from None
        return spec if self.params.infer == "method" else replace(spec, infer=self.params.infer)

    @property
    def federated(self) -> bool:
        return self.cfg.num_clients > 1

    @property
    def num_sources(self) -> int:
        return max(1, self.cfg.num_clients - 1)

    def domains(self) -> GraphDomains:
        """The source and target graphs: a generated CSBM pair or the authors' citation files."""
        p = self.params
        if p.dataset == "citation":
            if not p.citation_root:
                raise ConfigError("dataset=citation needs client.params.citation_root (the folder of the "
                                  "{name}.docs/edgelist/labels.txt files)")
            return citation_domains(p.citation_root, p.citation_source, p.citation_target, self.cfg.seed)
        return csbm_domains(p.graph, derive_seed(self.cfg.seed, "gda-graphs"))

    @property
    def task(self) -> GraphTask:
        """Every node's view of the graphs (built once)."""
        if self._task is None:
            from clients.graph.task import build_task

            p = self.params
            self._task = build_task(self.domains(), self.num_sources, p.imbalance, p.anchors, p.walks, p.path_len,
                                    self.cfg.seed, p.client_order, p.ppmi_clip)
        return self._task

    def head_tail(self) -> tuple[list[int], list[int]]:
        """Head and tail classes of the pooled long-tailed source."""
        from clients.graph.metrics import head_tail

        t = self.task
        return head_tail(t.pooled_sizes(), t.sources[0].order, self.params.tail_classes)

    def new_net(self) -> GraphNet:
        """A freshly initialised network (from the global torch RNG)."""
        from clients.graph.model import GraphNet

        t, p, s = self.task, self.params, self.spec
        return GraphNet(int(t.target.x.shape[1]), p.hidden, t.num_classes, p.dropout,
                        discriminator=bool(s.adversary), attention=s.attention)

    @property
    def net(self) -> GraphNet:
        """This process's working network (built once, its weights loaded by :meth:`load`)."""
        if self._net is None:
            self._net = self.new_net()
        return self._net

    def load(self, arrays: StateDict) -> GraphNet:
        """The working network with the shared weights of ``arrays`` (prototypes left out)."""
        net = self.net
        net.load_state_dict({k: v for k, v in arrays.items() if k not in (PROTO_SUM, PROTO_COUNT)})
        return net

    def shares_prototypes(self) -> bool:
        return self.federated and self.spec.prototypes

    def zero_prototypes(self) -> StateDict:
        """An all-zero prototype reply (sums ``[2, C, d]``, counts ``[C]``)."""
        c, d = self.task.num_classes, self.params.hidden
        return {PROTO_SUM: torch.zeros(2, c, d), PROTO_COUNT: torch.zeros(c)}

    def roles(self, partition_id: int) -> tuple[int | None, bool]:
        """(index of the source graph this node holds or None, whether it holds the target graph)."""
        if not self.federated:
            return 0, True
        if partition_id == self.cfg.num_clients - 1:
            return None, True
        return partition_id, False

    def tau(self, source_index: int) -> torch.Tensor:
        """Per-class temperatures of ``L_cb`` on source ``source_index``."""
        from clients.graph.losses import dynamic_temperature

        p, t = self.params, self.task
        if not self.spec.dynamic_tau:
            return torch.full((t.num_classes,), float(p.fixed_tau))
        counts = t.original_counts if p.temperature_counts == "original" else t.sources[source_index].sizes
        return dynamic_temperature(torch.tensor(counts), p.tau0)

    def weight(self, source_index: int | None, trains: bool) -> int:
        """A node's FedAvg weight: its source nodes, or ``target_weight`` average source nodes."""
        t = self.task
        if source_index is not None:
            return t.sources[source_index].num_nodes
        if not trains:
            return 0
        mean = np.mean([s.num_nodes for s in t.sources])
        return max(1, int(round(self.params.target_weight * mean))) if self.params.target_weight > 0 else 0

    def preflight(self) -> None:
        """Fail early, with one-line errors, on bad settings."""
        p = self.params
        self.spec  # an unknown method fails here
        checks = [
            (p.dataset in ("csbm", "citation"), f"client.params.dataset must be csbm or citation, got {p.dataset!r}"),
            (p.imbalance >= 1, f"client.params.imbalance (rho) must be >= 1, got {p.imbalance}"),
            (p.epochs_per_round >= 1, f"client.params.epochs_per_round must be >= 1, got {p.epochs_per_round}"),
            (p.lr > 0 and p.weight_decay >= 0, "client.params.lr must be > 0 and weight_decay >= 0"),
            (p.hidden >= 1 and 0 <= p.dropout < 1, "client.params.hidden must be >= 1 and dropout in [0, 1)"),
            (p.anchors >= 1, f"client.params.anchors must be >= 1, got {p.anchors}"),
            (0 < p.tau0 <= 1 and p.fixed_tau > 0 and p.cd_temperature > 0,
             "client.params.tau0 must be in (0, 1]; fixed_tau and cd_temperature > 0"),
            (p.temperature_counts in ("longtail", "original"),
             f"client.params.temperature_counts must be longtail or original, got {p.temperature_counts!r}"),
            (p.cd_denominator in ("class", "all"),
             f"client.params.cd_denominator must be class or all, got {p.cd_denominator!r}"),
            (p.walks >= 1 and p.path_len >= 1, "client.params.walks and path_len must be >= 1"),
            (p.infer in ("method", "local", "global"), f"client.params.infer must be method, local or global, got {p.infer!r}"),
            (p.selection in SELECTIONS, f"client.params.selection must be source_val or target_test, got {p.selection!r}"),
            (p.client_order in ("rotate", "same"), f"client.params.client_order must be rotate or same, got {p.client_order!r}"),
            (p.target_weight >= 0, f"client.params.target_weight must be >= 0, got {p.target_weight}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.federated and self.cfg.strategy.fraction_train < 1.0:
            raise ConfigError("the federated imgda variant needs every node each round (the target node alone "
                              "carries no weight); set strategy.fraction_train=1.0")
        if self.federated and self.cfg.strategy.name != "fedavg":
            log.warning("imgda: strategy %r; the shared prototypes are exact only under example-weighted "
                        "averaging (fedavg)", self.cfg.strategy.name)
        t = self.task
        if not 1 <= p.tail_classes < t.num_classes:
            raise ConfigError(f"client.params.tail_classes must be in 1..{t.num_classes - 1}, got {p.tail_classes}")
