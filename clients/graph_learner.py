"""Class-imbalanced graph domain adaptation as a fedsim learner: ImGDA, its ablations and baselines.

Paper: Ma et al., "Dual Prototype-Enhanced Contrastive Framework for Class-Imbalanced Graph Domain
Adaptation", NeurIPS 2025 (OpenReview QSK8VqiijI); code github.com/maxin88scu/ImGDA (research notes
``continual.md`` §4).  The algorithm as the authors code it (``main.py`` ``train()``), and where it
lives here:

1. the source graph's training split is made long-tailed with imbalance factor ``rho``
   (GraphENS-style low-degree removal; :func:`envs.graphs.long_tailed`);
2. a two-layer GCN with shared weights runs on two operators, the normalised adjacency (local
   branch) and a random-walk PPMI matrix (global branch) (:mod:`clients.graph.ppmi`,
   :mod:`clients.graph.model`); on the source, learnable per-node compensation vectors are added
   after each layer;
3. per class, the top-``k`` nodes by degree in each operator are the anchors; class prototypes are
   the class means; ``L_cb`` contrasts anchors against both branches' prototypes with the
   class-dependent temperature ``tau_y = tau0 + (1 - tau0) n_y / n_max``; ``L_cd`` pseudo-labels the
   target from the anchors and contrasts target nodes with their pseudo-class's anchors
   (:mod:`clients.graph.losses`, which lists the quirks kept);
4. ``L = L_ce (global branch, compensated) + L_cb + L_cd``, Adam (lr 0.01, weight decay 1e-3),
   full batch, 200 epochs; inference on the target with the global branch, no compensation.

**One round = ``epochs_per_round`` full-batch epochs** on each node; the server evaluates the global
model after every round (``eval/target_macro_f1``, ``eval/target_tail_f1``, ...,
``eval/source_val_macro_f1``).  Model selection happens in :meth:`GraphDALearner.final_report`:
by source-validation macro-F1 (the default, ``selection=source_val``; the val split is the authors'
10% of the original source graph, evaluated inside that whole graph) and by target-test micro-F1
(the authors' protocol, which is optimistic: it peeks at the target labels); both are reported
(``gda/source_val/*``, ``gda/target_test/*``), the headline ``gda/target_macro_f1`` follows
``selection``.

**Centralised** (``num_clients = 1``): node 0 holds the long-tailed source and the target graph and
runs the authors' algorithm (with the deviations listed at the end); its compensation vectors and
Adam moments persist across rounds in ``ctx.state``, so rounds only cut the 200 epochs into
evaluation points (FedAvg over one node returns that node's weights unchanged).

**Federated** (``num_clients = N >= 2``): nodes ``0..N-2`` hold disjoint random parts of the source
graph, each long-tailed with its own class order (:mod:`clients.graph.task`); node ``N-1`` holds
the unlabelled target graph.  What is shared and why:

* the GCN weights and the classifier (and a baseline's discriminator / attention): FedAvg,
  weighted by source training nodes; the target node's update carries the weight of an average
  source node times ``target_weight`` (0 in a round where it has nothing to train);
* class prototypes: every source node replies with its per-class embedding sums and counts
  (``proto.sum`` ``[2, C, d]``, ``proto.count`` ``[C]``), both divided by its FedAvg weight, so the
  weighted average of the replies gives ``sum / count`` over all source nodes exactly (the target
  node sends zeros).  The target node uses the previous round's global prototypes as the anchors
  of ``L_cd`` (all-class softmax; a single prototype per class makes the authors' class-only
  softmax identically zero), and with ``share_prototypes`` source nodes contrast their anchors
  with the global prototypes in ``L_cb`` (FedProto-style; they carry other clients' views of a
  client's tail classes);
* never shared: the compensation vectors (they belong to one source graph's nodes) and the Adam
  moments (node-local state).

The learner owns its data and model: ``cfg.data`` and ``cfg.model`` are ignored (the graphs come
from ``client.params.graph`` or the authors' citation files, the encoder from
``client.params.hidden``/``dropout``).

Deviations and reconstructions (besides those listed in the submodules): the graphs are a CSBM
generated in code (the authors' citation files are optional: ``dataset=citation``); encoder dims 64
instead of 512 and ``k = 40`` anchors instead of 200 (the graphs are ~4x smaller); the PPMI weights
are clipped at 0 by default (``ppmi_clip=false`` is the authors' code, which keeps negative PMI and
diverges on a federated client's few-hundred-node subgraph, see :mod:`clients.graph.ppmi`); the
temperature counts come from the long-tailed training graph by default
(``temperature_counts=original`` is the authors' whole-original-graph count, which on a balanced
original graph makes every ``tau_y = 1``); evaluation is deterministic (the authors' dropout stays
on at test time); the federated variant is a design of ours (the paper is centralised).

**Why the default CSBM run collapses (issue #30).**  The cause is the authors' own algorithm, not
a deviation of ours. ``fedsim run imgda`` (seed 0) ends at target macro-F1 0.107 with nearly every
target node in one class. Checked against the authors' ``main.py`` / ``utils.py`` / ``Models.py``,
the following all match: the loss formulas, signs and weights (1, 1, 1); L2 normalisation before
every similarity; prototypes taken as non-detached means over all class nodes; compensation on
both source branches in training only; inference with the global branch and no compensation;
Adam lr 0.01 / weight decay 1e-3; 200 epochs; the PPMI construction; and no GRL. There is no
pseudo-label threshold in their code (the argmax is always accepted). Per-epoch diagnostics
(seed 0):

* the global branch goes to one class from the first epochs (1,314 / 1,500 after epoch 0, about
  1,450 from epoch 10 on). The same model's *local* branch scores 0.48 on the target, against
  0.53 for the source-only GCN, and the global branch scores 0.72-0.78 on the source
  validation nodes;
* none of ImGDA's own terms is needed for the collapse. A GCN trained with CE alone on the global
  branch, with no compensation, ``L_cb`` or ``L_cd``, gets 0.14 (1,425 nodes in one class).
  ``temperature_counts=original ppmi_clip=false`` (the authors' exact knobs) gets 0.12.
  Compensation makes it worse (0.10 with it, 0.20 without; the classifier is fitted on
  compensated embeddings and predicts on uncompensated ones), but it is the authors' design;
* the trigger is the CSBM's target shift, amplified by PPMI. PPMI averages over up to 5 random-walk
  hops. On the target (homophily 0.67) the PPMI operator's same-class weight share is 0.45, and
  it keeps 0.34 of the centred class indicator per layer. The adjacency keeps 0.62 on the
  target, and PPMI keeps 0.71 on the long-tailed source it is trained on. A common feature offset
  passes either operator whole (row sums about 1). Target embeddings therefore sit near a shifted
  centre, and the classifier sends them to the class nearest it. The offset of seed 0 is most
  aligned with class 3's mean (cosine 0.16), and the collapse is onto class 3. Seed 2 collapses
  onto classes 3 and 4 (cosines 0.07, 0.16). Seed 1 (largest cosine 0.08) does not collapse
  (0.61);
* either shift alone is enough on seeds 0 and 2 (over seeds 0/1/2: feature shift only 0.41 / 0.95
  / 0.37; structure shift only 0.33 / 0.61 / 0.41). With no shift the global branch is sound
  (CE-only 0.73 / -- / 0.85; ImGDA 0.66 / -- / 0.87 on seeds 0 / 2). Feature separability does not
  rescue it: with ``graph.class_sep=2``, ImGDA scores 0.50 on average against 0.88 for source-only
  and 0.82 for ImGDA with ``infer=local``.

So on this CSBM, claim 1 (ImGDA beats the baselines) fails because the authors predict from the
PPMI branch, which is fragile to a target shift. ``infer=local`` is the diagnostic that separates
the branch from the losses. ``tests/clients/graph/test_imgda_collapse.py`` pins both halves:
the global branch is sound without a shift and loses to the local one under it.
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from clients.graph.baselines import METHODS, MethodSpec
from envs.graphs import CSBMParams, GraphDomains, citation_domains, csbm_domains
from fedsim.config import ExperimentConfig
from fedsim.errors import ConfigError
from fedsim.registry import LEARNERS
from fedsim.seeding import derive_seed, seed_torch, torch_generator

if TYPE_CHECKING:  # the PyG-based modules load on first use: registering the learner stays cheap
    from clients.graph.model import Compensation, GraphNet
    from clients.graph.task import GraphTask, GraphView
    from fedsim.contracts.history import History

log = logging.getLogger("fedsim")

#: ``context.state`` record of a node's compensation vectors and optimiser moments.
STATE_KEY = "gda-node"
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


@LEARNERS.register("imgda", params=GraphDAParams,
                   summary="class-imbalanced graph domain adaptation on PyG (ImGDA, ablations, source/balanced/"
                           "DANN/UDAGCN baselines), centralised or federated")
class GraphDALearner(Learner):
    """ImGDA and its baselines; one round = ``epochs_per_round`` full-batch epochs per node."""

    privacy_unit = ("node-level DP is not implemented: message passing couples a node's loss with its "
                    "neighbours' features, so one node is not one clippable example without bounded-degree sampling")

    owns_environment = True  # the source/target graphs and the GCN come from client.params

    def __init__(self, cfg: ExperimentConfig, params: GraphDAParams) -> None:
        super().__init__(cfg, params)
        self._task: GraphTask | None = None
        self._net: GraphNet | None = None

    # -- set-up -------------------------------------------------------------------------------------
    @property
    def spec(self) -> MethodSpec:
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
        p = self.params
        if p.dataset == "citation":
            if not p.citation_root:
                raise ConfigError("dataset=citation needs client.params.citation_root (the folder of the "
                                  "{name}.docs/edgelist/labels.txt files)")
            return citation_domains(p.citation_root, p.citation_source, p.citation_target, self.cfg.seed)
        return csbm_domains(p.graph, derive_seed(self.cfg.seed, "gda-graphs"))

    @property
    def task(self) -> GraphTask:
        if self._task is None:
            from clients.graph.task import build_task

            p = self.params
            self._task = build_task(self.domains(), self.num_sources, p.imbalance, p.anchors, p.walks, p.path_len,
                                    self.cfg.seed, p.client_order, p.ppmi_clip)
        return self._task

    def head_tail(self) -> tuple[list[int], list[int]]:
        from clients.graph.metrics import head_tail

        t = self.task
        return head_tail(t.pooled_sizes(), t.sources[0].order, self.params.tail_classes)

    def new_net(self) -> GraphNet:
        from clients.graph.model import GraphNet

        t, p, s = self.task, self.params, self.spec
        return GraphNet(int(t.target.x.shape[1]), p.hidden, t.num_classes, p.dropout,
                        discriminator=bool(s.adversary), attention=s.attention)

    @property
    def net(self) -> GraphNet:
        if self._net is None:
            self._net = self.new_net()
        return self._net

    def shares_prototypes(self) -> bool:
        return self.federated and self.spec.prototypes

    def preflight(self) -> None:
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

    def local_work(self, partition_id: int) -> float:
        return float(self.params.epochs_per_round)

    # -- arrays ---------------------------------------------------------------------------------------
    def init_arrays(self) -> StateDict:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.cfg.seed, "gda-init") % 2**63)
            net = self.new_net()
        arrays = {k: v.detach().clone() for k, v in net.state_dict().items()}
        if self.shares_prototypes():
            arrays.update(self._zero_prototypes())
        return arrays

    def _zero_prototypes(self) -> StateDict:
        c, d = self.task.num_classes, self.params.hidden
        return {PROTO_SUM: torch.zeros(2, c, d), PROTO_COUNT: torch.zeros(c)}

    def _load(self, arrays: StateDict) -> GraphNet:
        net = self.net
        net.load_state_dict({k: v for k, v in arrays.items() if k not in (PROTO_SUM, PROTO_COUNT)})
        return net

    @staticmethod
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

    # -- node roles -------------------------------------------------------------------------------------
    def roles(self, partition_id: int) -> tuple[int | None, bool]:
        """(index of the source graph this node holds or None, whether it holds the target graph)."""
        if not self.federated:
            return 0, True
        if partition_id == self.cfg.num_clients - 1:
            return None, True
        return partition_id, False

    def _tau(self, source_index: int) -> torch.Tensor:
        from clients.graph.losses import dynamic_temperature

        p, t = self.params, self.task
        if not self.spec.dynamic_tau:
            return torch.full((t.num_classes,), float(p.fixed_tau))
        counts = t.original_counts if p.temperature_counts == "original" else t.sources[source_index].sizes
        return dynamic_temperature(torch.tensor(counts), p.tau0)

    def _weight(self, source_index: int | None, trains: bool) -> int:
        t = self.task
        if source_index is not None:
            return t.sources[source_index].num_nodes
        if not trains:
            return 0
        mean = np.mean([s.num_nodes for s in t.sources])
        return max(1, int(round(self.params.target_weight * mean))) if self.params.target_weight > 0 else 0

    # -- Learner API ------------------------------------------------------------------------------------
    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        from clients.graph.objective import TERMS, LossKnobs, node_losses

        p, s, t = self.params, self.spec, self.task
        net = self._load(arrays)
        si, has_target = self.roles(ctx.partition_id)
        source = t.sources[si] if si is not None else None
        target = t.target if has_target and s.uses_target else None
        protos = self.global_prototypes(arrays) if self.federated else None
        trains = source is not None or (target is not None and (bool(s.adversary) or s.entropy or protos is not None))
        state = ctx.state[STATE_KEY].to_torch_state_dict() if STATE_KEY in ctx.state else {}
        comp = self._compensation(source, state, ctx.partition_id) if source is not None and s.compensation else None
        params = list(net.parameters()) + (list(comp.parameters()) if comp is not None else [])
        opt = torch.optim.Adam(params, lr=p.lr, weight_decay=p.weight_decay)
        if p.keep_optimizer_state:
            _load_optimizer(opt, state)
        tau = self._tau(si) if source is not None and s.cross_branch else None
        knobs = LossKnobs(p.w_cb, p.w_cd, p.w_domain, p.cd_temperature, p.cd_denominator)
        sums = {k: 0.0 for k in TERMS}
        epochs = self.cfg.rounds * p.epochs_per_round
        seed_torch(ctx.seed("gda-dropout"))
        net.train()
        if trains:
            for i in range(p.epochs_per_round):
                terms = node_losses(s, net, knobs, source=source, compensation=comp() if comp is not None else None,
                                    tau=tau, target=target, prototypes=protos, shared_cb=p.share_prototypes,
                                    epoch=(ctx.server_round - 1) * p.epochs_per_round + i, epochs=epochs)
                loss = sum(terms.values())
                opt.zero_grad()
                loss.backward()
                opt.step()
                for k, v in terms.items():
                    sums[k] += float(v.detach()) / p.epochs_per_round
        new_state = {f"comp.{i}": v.detach().clone() for i, v in enumerate(comp.vectors)} if comp is not None else {}
        new_state.update(_optimizer_state(opt) if p.keep_optimizer_state else {})
        ctx.state[STATE_KEY] = ArrayRecord(new_state)
        weight = self._weight(si, trains)
        shared = {k: v.detach().clone() for k, v in net.state_dict().items()}
        if self.shares_prototypes():
            shared.update(self._reply_prototypes(net, source, comp, weight))
        metrics = {"loss": sum(sums.values()), **{f"loss_{k}": v for k, v in sums.items()},
                   "trained": float(trains), "holds_target": float(has_target)}
        return TrainResult(shared, num_examples=weight, metrics=metrics)

    def _compensation(self, source: GraphView, state: StateDict, partition_id: int) -> Compensation:
        from clients.graph.model import Compensation

        comp = Compensation(source.num_nodes, self.params.hidden,
                            generator=torch_generator(self.cfg.seed, "gda-compensation", partition_id))
        if "comp.0" in state:
            with torch.no_grad():
                for i, v in enumerate(comp.vectors):
                    v.copy_(state[f"comp.{i}"])
        return comp

    def _reply_prototypes(self, net: GraphNet, source: GraphView | None, comp: Compensation | None,
                          weight: int) -> StateDict:
        """Per-class embedding sums and counts of this node's source graph, divided by its FedAvg weight."""
        from clients.graph.losses import prototype_sums

        if source is None or weight == 0:
            return self._zero_prototypes()
        net.eval()
        with torch.no_grad():
            vectors = comp() if comp is not None else None
            z_local, z_global = net.encoder(source.x, source.local, vectors), net.encoder(source.x, source.glob, vectors)
            c = self.task.num_classes
            (sl, counts), (sg, _) = prototype_sums(z_local, source.y, c), prototype_sums(z_global, source.y, c)
        return {PROTO_SUM: torch.stack([sl, sg]) / weight, PROTO_COUNT: counts / weight}

    def _predict(self, net: GraphNet, g: GraphView) -> torch.Tensor:
        from clients.graph.objective import embed

        net.eval()
        with torch.no_grad():
            return net.classifier(embed(self.spec, net, g)).argmax(1)

    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        """Macro-F1 of the global model on the node's own graph (its long-tailed source, or the target)."""
        from clients.graph.metrics import f1_report

        net = self._load(arrays)
        si, _ = self.roles(ctx.partition_id)
        g = self.task.sources[si] if si is not None else self.task.target
        c = self.task.num_classes
        return EvalResult(num_examples=g.num_nodes, metrics={"macro_f1": f1_report(self._predict(net, g), g.y, c)["macro_f1"]})

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        """Target F1 (macro, micro, head, tail, per class) and source-validation F1 of the global model."""
        from clients.graph.metrics import f1_report

        net, t = self._load(arrays), self.task
        head, tail = self.head_tail()
        out = {f"target_{k}": v for k, v in f1_report(self._predict(net, t.target), t.target.y, t.num_classes,
                                                       head, tail).items()}
        pred = self._predict(net, t.source_eval)[t.val_mask]
        val = f1_report(pred, t.source_eval.y[t.val_mask], t.num_classes)
        out.update({"source_val_macro_f1": val["macro_f1"], "source_val_micro_f1": val["micro_f1"]})
        return out

    def setup_summary(self) -> dict[str, Any]:
        t = self.task
        head, tail = self.head_tail()
        out: dict[str, Any] = {"gda.target_nodes": t.target.num_nodes, "gda.source_eval_nodes": t.source_eval.num_nodes,
                               "gda.head_classes": "/".join(map(str, head)), "gda.tail_classes": "/".join(map(str, tail))}
        for i, s in enumerate(t.sources):
            out[f"gda.source{i}.nodes"] = s.num_nodes
            out[f"gda.source{i}.class_sizes"] = "/".join(map(str, s.sizes))
        return out

    def setup_artifacts(self, out_dir: Path) -> list[Path]:
        from envs.plots import plot_label_histogram

        t = self.task
        hist = np.asarray([s.sizes for s in t.sources])
        return [plot_label_histogram(hist, out_dir / "gda_class_sizes.png",
                                     title=f"long-tailed source class sizes per source node (rho={self.params.imbalance:g})")]

    # -- the run's report ---------------------------------------------------------------------------------
    def final_report(self, history: "History", out_dir: Path | None) -> tuple[dict[str, float], list[Path]]:
        rows = [(r.round, r.metrics) for r in history.records if r.round >= 1 and "eval/target_macro_f1" in r.metrics]
        if not rows:
            return {}, []
        c = self.task.num_classes
        picks = {"source_val": _argmax(rows, "eval/source_val_macro_f1"), "target_test": _argmax(rows, "eval/target_micro_f1")}
        keys = ["target_macro_f1", "target_micro_f1", "target_head_f1", "target_tail_f1", "source_val_macro_f1",
                *(f"target_f1_c{k}" for k in range(c))]
        metrics: dict[str, float] = {}
        for name, (rnd, m) in picks.items():
            metrics[f"gda/{name}/round"] = float(rnd)
            metrics.update({f"gda/{name}/{k}": m[f"eval/{k}"] for k in keys if f"eval/{k}" in m})
        last = rows[-1][1]
        metrics.update({f"gda/last/{k}": last[f"eval/{k}"] for k in keys[:4] if f"eval/{k}" in last})
        chosen = self.params.selection
        metrics.update({f"gda/{k}": metrics[f"gda/{chosen}/{k}"] for k in keys[:4] if f"gda/{chosen}/{k}" in metrics})
        metrics["gda/selection_optimism"] = metrics["gda/target_test/target_macro_f1"] - metrics["gda/source_val/target_macro_f1"]
        files: list[Path] = []
        if out_dir is not None:
            files = self._plots(rows, picks, out_dir)
        return {k: float(v) for k, v in metrics.items() if math.isfinite(v)}, files

    def _plots(self, rows: list[tuple[int, dict[str, float]]], picks: dict[str, tuple[int, dict[str, float]]],
               out_dir: Path) -> list[Path]:
        from clients.graph.plots import plot_class_f1, plot_f1_rounds
        from fedsim.metrics.plots import save

        t, p = self.task, self.params
        _, tail = self.head_tail()
        title = (f"{p.method}: rho={p.imbalance:g}, {self.cfg.num_clients} node(s), "
                 f"{p.epochs_per_round} epochs/round, seed {self.cfg.seed}")
        rounds = [r for r, _ in rows]
        names = {"target macro-F1": "eval/target_macro_f1", "target tail F1": "eval/target_tail_f1",
                 "target head F1": "eval/target_head_f1", "source val macro-F1": "eval/source_val_macro_f1"}
        series = {label: [m.get(k, math.nan) for _, m in rows] for label, k in names.items()}
        files = [save(plot_f1_rounds(rounds, series, {k: v[0] for k, v in picks.items()}, title),
                      out_dir / "gda_f1_rounds.png")]
        per_class = {f"selected by {name} (round {r})": [m.get(f"eval/target_f1_c{k}", math.nan) for k in range(t.num_classes)]
                     for name, (r, m) in picks.items()}
        files.append(save(plot_class_f1(per_class, t.pooled_sizes(), tail, title), out_dir / "gda_class_f1.png"))
        table = out_dir / "gda_rounds.csv"
        keys = sorted({k for _, m in rows for k in m if k.startswith("eval/")})
        with table.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["round", *keys])
            for r, m in rows:
                w.writerow([r, *(m.get(k, "") for k in keys)])
        files.append(table)
        return files


def _argmax(rows: list[tuple[int, dict[str, float]]], key: str) -> tuple[int, dict[str, float]]:
    """The first round with the largest ``key`` (NaN counts as lowest)."""
    best = max(range(len(rows)), key=lambda i: (_finite(rows[i][1].get(key, math.nan)), -i))
    return rows[best]


def _finite(v: float) -> float:
    return v if math.isfinite(v) else -math.inf


def _optimizer_state(opt: torch.optim.Optimizer) -> StateDict:
    """Adam's per-parameter moments and step counts, flattened for an ArrayRecord."""
    out = {}
    for i, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            out[f"opt.{i}.{name}"] = (value if torch.is_tensor(value) else torch.tensor(float(value))).detach().clone()
    return out


def _load_optimizer(opt: torch.optim.Optimizer, state: StateDict) -> None:
    entries: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            entries.setdefault(int(i), {})[name] = value.clone()
    if entries:
        sd = opt.state_dict()
        sd["state"] = entries
        opt.load_state_dict(sd)
