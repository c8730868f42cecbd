"""One node's training round of an ``imgda`` run: ``epochs_per_round`` full-batch epochs of the
method's objective (:func:`clients.graph.objective.node_losses`), the node-local state kept in
``ctx.state`` (compensation vectors and Adam moments) and the reply (weights, and in the federated
variant the node's prototype sums and counts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from flwr.app import ArrayRecord

from clients.graph.environment import PROTO_COUNT, PROTO_SUM, GraphEnvironment, global_prototypes
from fedsim.contracts.learner import NodeContext, StateDict, TrainResult
from fedsim.seeding import seed_torch, torch_generator

if TYPE_CHECKING:
    from clients.graph.model import Compensation, GraphNet
    from clients.graph.task import GraphView

__all__ = ["STATE_KEY", "train_node"]

#: ``context.state`` record of a node's compensation vectors and optimiser moments.
STATE_KEY = "gda-node"


def train_node(env: GraphEnvironment, arrays: StateDict, ctx: NodeContext) -> TrainResult:
    """Train the global model of ``arrays`` on the graphs of node ``ctx.partition_id`` for one round."""
    from clients.graph.objective import TERMS, LossKnobs, node_losses

    p, s, t = env.params, env.spec, env.task
    net = env.load(arrays)
    si, has_target = env.roles(ctx.partition_id)
    source = t.sources[si] if si is not None else None
    target = t.target if has_target and s.uses_target else None
    protos = global_prototypes(arrays) if env.federated else None
    trains = source is not None or (target is not None and (bool(s.adversary) or s.entropy or protos is not None))
    state = ctx.state[STATE_KEY].to_torch_state_dict() if STATE_KEY in ctx.state else {}
    comp = _compensation(env, source, state, ctx.partition_id) if source is not None and s.compensation else None
    params = list(net.parameters()) + (list(comp.parameters()) if comp is not None else [])
    opt = torch.optim.Adam(params, lr=p.lr, weight_decay=p.weight_decay)
    if p.keep_optimizer_state:
        load_optimizer(opt, state)
    tau = env.tau(si) if source is not None and s.cross_branch else None
    knobs = LossKnobs(p.w_cb, p.w_cd, p.w_domain, p.cd_temperature, p.cd_denominator)
    sums = {k: 0.0 for k in TERMS}
    epochs = env.cfg.rounds * p.epochs_per_round
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
    new_state.update(optimizer_state(opt) if p.keep_optimizer_state else {})
    ctx.state[STATE_KEY] = ArrayRecord(new_state)
    weight = env.weight(si, trains)
    shared = {k: v.detach().clone() for k, v in net.state_dict().items()}
    if env.shares_prototypes():
        shared.update(reply_prototypes(env, net, source, comp, weight))
    metrics = {"loss": sum(sums.values()), **{f"loss_{k}": v for k, v in sums.items()},
               "trained": float(trains), "holds_target": float(has_target)}
    return TrainResult(shared, num_examples=weight, metrics=metrics)


def _compensation(env: GraphEnvironment, source: GraphView, state: StateDict, partition_id: int) -> Compensation:
    """The source graph's compensation vectors: restored from ``state``, or freshly drawn."""
    from clients.graph.model import Compensation

    comp = Compensation(source.num_nodes, env.params.hidden,
                        generator=torch_generator(env.cfg.seed, "gda-compensation", partition_id))
    if "comp.0" in state:
        with torch.no_grad():
            for i, v in enumerate(comp.vectors):
                v.copy_(state[f"comp.{i}"])
    return comp


def reply_prototypes(env: GraphEnvironment, net: GraphNet, source: GraphView | None, comp: Compensation | None,
                     weight: int) -> StateDict:
    """Per-class embedding sums and counts of this node's source graph, divided by its FedAvg weight."""
    from clients.graph.losses import prototype_sums

    if source is None or weight == 0:
        return env.zero_prototypes()
    net.eval()
    with torch.no_grad():
        vectors = comp() if comp is not None else None
        z_local, z_global = net.encoder(source.x, source.local, vectors), net.encoder(source.x, source.glob, vectors)
        c = env.task.num_classes
        (sl, counts), (sg, _) = prototype_sums(z_local, source.y, c), prototype_sums(z_global, source.y, c)
    return {PROTO_SUM: torch.stack([sl, sg]) / weight, PROTO_COUNT: counts / weight}


def optimizer_state(opt: torch.optim.Optimizer) -> StateDict:
    """Adam's per-parameter moments and step counts, flattened for an ArrayRecord."""
    out = {}
    for i, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            out[f"opt.{i}.{name}"] = (value if torch.is_tensor(value) else torch.tensor(float(value))).detach().clone()
    return out


def load_optimizer(opt: torch.optim.Optimizer, state: StateDict) -> None:
    """Restore the moments that :func:`optimizer_state` flattened (nothing without any)."""
    entries: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            entries.setdefault(int(i), {})[name] = value.clone()
    if entries:
        sd = opt.state_dict()
        sd["state"] = entries
        opt.load_state_dict(sd)
