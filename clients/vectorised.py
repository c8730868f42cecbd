"""Vectorised clients: train a round's whole cohort of supervised clients together with ``torch.func``.

:func:`train_cohort` returns, for every ``(arrays, ctx)`` of a cohort, what
``SupervisedLearner.train(arrays, ctx)`` returns (arrays, ``num_examples``, ``train_loss``,
``local_steps`` and the transform metrics), but runs the cohort's local steps as one batched
computation: the clients' models are stacked along a leading client axis and every optimiser step
of a chunk of clients is a single ``vmap(grad_and_value(loss))`` over ``functional_call`` followed
by a batched optimiser update.

Why it is exact (up to the float rounding of batched kernels: measured max |Δw| 6e-8 after 4-16
steps and 4e-7 after 40 momentum steps of the small CNN; the tests check ``atol=1e-5``):

* per client, the preparation is the learner's own, in the same order: ``_load``, the proximal
  anchor taken before the transforms, ``apply_transforms`` on the learner's model, then the state
  is read back (a client without transforms whose arrays a strict load would accept is copied
  straight into the stack: loading is then a plain copy);
* each client's batches are the ones ``iterate_batches`` draws from the same
  ``torch.Generator().manual_seed(ctx.seed("batches"))`` (:func:`batch_schedule` draws the same
  permutations), and it takes ``num_local_steps(len(y), cfg)`` steps;
* batches are padded to a common width; the loss is the cross-entropy averaged over the client's
  real examples only (padded rows get weight 0, so they add exactly 0 to the gradient), plus
  FedProx's ``(mu/2)||w - w_global||^2`` when the client's round config carries ``"proximal-mu"``;
* the update is one ``step()`` of the learner's own optimiser (:func:`clients.supervised.optimizer_for`,
  ``torch.optim.SGD`` or ``torch.optim.Adam`` with the client's settings) over the stacked
  parameters: both are element-wise, so a step on ``[C, ...]`` is each client's step (finished
  clients' slices are put back); ``grad_clip`` is the per-client global-norm clip of
  ``clip_grad_norm_``;
* clients are sorted by their number of steps, so the clients still training at any step are a
  prefix of the chunk: the others are simply not computed any more.

Under sample-level DP-SGD (``privacy.level=sample``) each client's round is the one Opacus runs for
it (:func:`privacy.dp_sgd.private_local_training`), drawn from the same seeds by
:mod:`privacy.cohort`: the client's Poisson batches (so a batch has a width of its own, padded to
the chunk's widest; an empty batch is a noise-only step), every example's gradient of the
cross-entropy (``vmap`` over the batch inside ``vmap`` over clients), clipped to
``privacy.max_grad_norm``, summed, noised with the client's own σ from its own noise stream and
divided by its expected batch size, DP-FedProx's proximal gradient added after the noise, then the
learner's optimiser step; the budget check, the ledger metrics and the privacy state in
``ctx.state`` are :class:`privacy.facade.PrivateTrainer`'s own (``begin_round``/``end_round``).  A
chunk holds at most :data:`DP_CHUNK_ELEMENTS` per-example gradient elements.  A cohort with a client
whose budget is exhausted, or with ghost clipping, is trained one by one.

Valid only where the result is exactly the sequential one (:func:`vectorise_unsupported` says why
not): a ``SupervisedLearner`` that keeps its methods named in :data:`KEPT_METHODS`,
an SGD or Adam optimiser, no batch-statistics normalisation (BatchNorm, or any
norm with running stats), no active dropout (``vmap`` runs with ``randomness="error"``, so any
other random op in the forward pass raises rather than silently differing), no adapter models
(``federated_keys``: their cohorts train on one shared frozen base, with each client's own dropout
masks, in :mod:`clients.lora_cohort`), no tied parameters, and every client has at least one
training example.

A failure anywhere (e.g. a transform raising for one client) fails the whole call; a caller that
needs per-client failure semantics falls back to sequential training then.

``engine.vectorise=auto`` (the default) vectorises only where it is exact *and* measured faster
(:func:`auto_vectorise`): models of ``Linear`` layers with at most :data:`AUTO_MAX_PARAMS` parameters
and a per-client step of at most :data:`AUTO_MAX_STEP_WORK` parameter-examples.
``benchmarks/bench_vectorise.py`` times both paths over a grid of MLPs, a logistic regression and the small CNN (10-1000 clients, 4-400 examples,
batch 16/64, SGD/Adam) and fails if ``auto`` vectorises anywhere the cohort is slower; convolutions
stay sequential because the batched kernels lose to one-by-one training there at 10-100 clients
(0.4-0.6x), and so do MLPs past 30k parameters (a 784-128-4 MLP: 0.8-0.9x at 1000 clients).

Measured speed (MLP ``hidden=[32]``, 200 clients, 1 local epoch at batch 16, momentum 0.9,
``torch.set_num_threads(1)``, best of 3 on a loaded 2-core machine): MNIST iid (16 examples, 1 step
per client) sequential 0.45 s, vectorised 0.12 s (3.7x; the per-client preparation dominates);
synthetic Dirichlet (12-143 examples, 1-9 steps) sequential 1.05 s, vectorised 0.09 s (12x) with
chunk 256, 0.19 s with chunk 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.dropout import _DropoutNd

from fedsim.config import ExperimentConfig
from fedsim.contracts.learner import Learner, NodeContext, StateDict, TrainResult
from fedsim.contracts.wire import PROXIMAL_MU
from clients.supervised import SupervisedLearner, make_optimizer, num_local_steps, optimizer_for
from fedsim.device import to_host
from fedsim.seeding import prime_seeds, seed_torch
from fedsim.contracts.transforms import apply_transforms
from fedsim.contracts.wire import TRANSFORM_KEY
from privacy.cohort import expected_batch_size, noise_draws, poisson_masks, privatise
from privacy.facade import PrivacyBudgetExhausted, round_seeds
from privacy.plan import ClientPrivacyPlan

#: Methods a learner must inherit unchanged from SupervisedLearner for the result to be the same.
KEPT_METHODS = ("train", "_train_plain", "loss", "_reply_arrays", "_train_private", "_proximal_after_noise")

Tensors = dict[str, torch.Tensor]


# -- validity -------------------------------------------------------------------------------------

def _optimizer_unsupported(learner: SupervisedLearner) -> str | None:
    opt = make_optimizer(learner.model, learner.cfg)
    d = opt.defaults
    if type(opt) is torch.optim.SGD:
        if d["nesterov"] or d["dampening"] != 0 or d["maximize"]:
            return "SGD with nesterov, dampening or maximize is not implemented"
        return None
    if type(opt) is torch.optim.Adam:
        if d["amsgrad"] or d["maximize"] or d.get("decoupled_weight_decay", False):
            return "Adam with amsgrad, maximize or decoupled weight decay is not implemented"
        return None
    return f"optimizer {type(opt).__name__} is not implemented (only SGD and Adam)"


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether ``module`` normalises with batch statistics or keeps running stats (rows are not independent)."""
    return isinstance(module, _BatchNorm) or (isinstance(module, _NormBase) and module.track_running_stats)


def overridden_method(learner: SupervisedLearner, names: tuple[str, ...]) -> str | None:
    """Why a cohort would not be ``learner``'s own round: the first of ``names`` its class overrides."""
    for name in names:
        if getattr(type(learner), name) is not getattr(SupervisedLearner, name):
            return f"{type(learner).__name__} overrides SupervisedLearner.{name}"
    return None


def _model_unsupported(model: nn.Module) -> str | None:
    if hasattr(model, "federated_keys"):
        return "adapter models (federated_keys) train as LoRA cohorts (clients.lora_cohort), not here"
    for name, m in model.named_modules():
        if uses_batch_statistics(m):
            return f"module {name!r} ({type(m).__name__}) uses batch statistics or running stats"
        if isinstance(m, _DropoutNd) and m.p > 0:
            return f"module {name!r} is an active dropout (p={m.p}): its random masks would differ"
    if len(list(model.named_parameters(remove_duplicate=False))) != len(list(model.named_parameters())):
        return "models with tied (shared) parameters are not supported"
    if not any(p.requires_grad for p in model.parameters()):
        return "the model has no trainable parameters"
    return None


def vectorise_unsupported(learner: Learner, ctxs: list[NodeContext]) -> str | None:
    """Why this cohort cannot be trained exactly by :func:`train_cohort` (None: it can)."""
    if not isinstance(learner, SupervisedLearner):
        return f"learner {type(learner).__name__} is not a SupervisedLearner"
    reason = overridden_method(learner, KEPT_METHODS)
    if reason is not None:
        return reason
    if learner.sample_level_dp and learner.cfg.privacy.grad_sample_mode == "ghost":
        return "DP-SGD with privacy.grad_sample_mode=ghost (ghost clipping) is not vectorised"
    return _model_unsupported(learner.model) or _optimizer_unsupported(learner) or client_refusal(learner, ctxs)


def client_refusal(learner: SupervisedLearner, ctxs: list[NodeContext]) -> str | None:
    """Why one of the cohort's clients trains on its own: no training example, or (DP-SGD) past its budget."""
    for ctx in ctxs:
        n = len(learner.data.client_train(ctx.partition_id, ctx.server_round).y)
        if n == 0:
            return f"client {ctx.partition_id} has no training examples"
        if learner.sample_level_dp:
            try:
                learner.dp.begin_round(ctx, n)
            except PrivacyBudgetExhausted as exc:  # it fails on its own, one by one
                return str(exc)
    return None


#: Parametrised layers the ``auto`` rule vectorises: on them the batched kernels beat one-by-one
#: training across the grid of ``benchmarks/bench_vectorise.py``; on convolutions they do not.
AUTO_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear,)
#: The largest model the ``auto`` rule vectorises, in trainable parameters.  The stacked update of a
#: chunk of clients moves chunk x parameters x (weights, gradients, optimiser state) per step; at
#: 101k parameters (784-128-4) and 1000 clients of 4 examples that lost to one-by-one training
#: (0.82-0.92x), at 25.6k (20-1024-4) it won everywhere measured (1.03-2.3x).
AUTO_MAX_PARAMS = 30_000
#: The largest per-client step the ``auto`` rule vectorises, in parameters x examples per batch.
#: Beyond it the cohort's compute, not Python's per-client overhead, dominates and the measured
#: gain shrinks to a tie or a loss (25.6k parameters at batch 64: 1.03-1.07x in one run).
AUTO_MAX_STEP_WORK = 1_000_000


def auto_vectorise(learner: Learner, ctxs: list[NodeContext]) -> str | None:
    """``engine.vectorise=auto``: why this cohort is trained one by one (None: it is vectorised).

    Vectorised where it is exact (:func:`vectorise_unsupported`) and measured faster
    (``benchmarks/bench_vectorise.py``): a cohort of at least two clients, a model whose parametrised
    layers are all :data:`AUTO_LAYERS`, at most :data:`AUTO_MAX_PARAMS` trainable parameters and a
    per-client step (trainable parameters x examples per batch) of at most :data:`AUTO_MAX_STEP_WORK`
    (not under DP-SGD, where Opacus' per-client cost makes the cohort faster at every step size measured).
    """
    if len(ctxs) < 2:
        return "a cohort of one client"
    reason = vectorise_unsupported(learner, ctxs)
    if reason is not None:
        return reason
    model: nn.Module = learner.model  # type: ignore[attr-defined]
    for name, m in model.named_modules():
        if any(True for _ in m.parameters(recurse=False)) and not isinstance(m, AUTO_LAYERS):
            return (f"module {name!r} ({type(m).__name__}) is not a layer the auto rule vectorises "
                    f"({', '.join(t.__name__ for t in AUTO_LAYERS)}; engine.vectorise=true forces it)")
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if params > AUTO_MAX_PARAMS:
        return (f"the model's {params:,} trainable parameters are past the {AUTO_MAX_PARAMS:,} up to which the "
                f"vectorised cohort was measured faster (engine.vectorise=true forces it)")
    if learner.sample_level_dp:  # type: ignore[attr-defined]
        return None  # DP cohorts won at every step size measured (bench_vectorise.py --dp: 1.19-16x)
    largest = max(len(learner.data.client_train(c.partition_id, c.server_round).y) for c in ctxs)  # type: ignore[attr-defined]
    work = params * min(largest, learner.cfg.client.batch_size)  # type: ignore[attr-defined]
    if work > AUTO_MAX_STEP_WORK:
        return (f"a local step of {work:,} parameter-examples is past the {AUTO_MAX_STEP_WORK:,} up to which the "
                f"vectorised cohort was measured faster (engine.vectorise=true forces it)")
    return None


# -- per-client preparation -----------------------------------------------------------------------

def batch_schedule(n: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """The first ``steps`` batches of ``iterate_batches(n, batch_size, Generator(seed))`` as rows of a
    ``[steps, batch_size]`` index tensor, short batches padded with -1."""
    g = torch.Generator().manual_seed(seed)
    per_epoch = -(-n // batch_size)
    epochs = -(-steps // per_epoch)
    padded = torch.full((epochs, per_epoch * batch_size), -1, dtype=torch.long)
    for e in range(epochs):
        padded[e, :n] = torch.randperm(n, generator=g)
    return padded.view(epochs * per_epoch, batch_size)[:steps]


@dataclass
class PrivateRound:
    """What Opacus would draw for one client's DP-SGD round (:mod:`privacy.cohort`)."""

    plan: ClientPrivacyPlan
    masks: torch.Tensor  # [steps, examples] bool: each logical (Poisson) batch
    noise: list[torch.Tensor]  # per trainable parameter, [steps, *shape]
    batch_size: int  # the expected batch size the privatised gradient is divided by


def private_round(learner: SupervisedLearner, ctx: NodeContext, n: int, params: list[torch.Tensor]) -> PrivateRound:
    """Client ``ctx``'s Opacus round over ``n`` examples from its seeds (after the budget check): its Poisson
    batches and, per trainable parameter in the optimiser's order (``params``), its noise."""
    cfg = learner.cfg
    plan = learner.dp.begin_round(ctx, n)
    batch_seed, noise_seed = round_seeds(ctx)
    masks = poisson_masks(n, cfg.client.batch_size, plan.steps_per_round, batch_seed)
    std = plan.noise_multiplier * cfg.privacy.max_grad_norm
    noise = noise_draws([p.shape for p in params], params[0].dtype, std, plan.steps_per_round, noise_seed,
                        params[0].device)
    return PrivateRound(plan, masks, noise, expected_batch_size(n, cfg.client.batch_size))


@dataclass
class _Client:
    """One client's round: what it received, its data and its batch schedule."""

    arrays: StateDict
    ctx: NodeContext
    x: torch.Tensor
    y: torch.Tensor
    batches: torch.Tensor  # [steps, width] local indices, -1 = padding
    mu: float  # FedProx's coefficient, 0 without the proximal term
    dp: PrivateRound | None = None  # sample-level DP-SGD: the client's Opacus round

    @property
    def steps(self) -> int:
        return self.batches.shape[0]


def _plan(learner: SupervisedLearner, arrays: StateDict, ctx: NodeContext) -> _Client:
    x, y = learner._tensors(learner.data.client_train(ctx.partition_id, ctx.server_round))
    mu = float(ctx.config[PROXIMAL_MU]) if PROXIMAL_MU in ctx.config else 0.0
    b = learner.cfg.client.batch_size
    if not learner.sample_level_dp:
        steps = num_local_steps(len(y), learner.cfg)
        batches = batch_schedule(len(y), b, steps, ctx.seed("batches"))[:, : min(b, len(y))]
        return _Client(arrays, ctx, x, y, batches, mu)
    dp = private_round(learner, ctx, len(y), [p for p in learner.model.parameters() if p.requires_grad])
    return _Client(arrays, ctx, x, y, _mask_rows(dp.masks), mu, dp)


def _prime_round_seeds(learner: SupervisedLearner, ctxs: list[NodeContext]) -> None:
    """Derive the cohort's per-client seeds of the learner's streams (``Learner.seed_streams``) in one
    vectorised pass each (:func:`fedsim.seeding.prime_seeds`; the same integers as one by one)."""
    rounds = {(c.root_seed, c.server_round) for c in ctxs}
    if len(rounds) != 1:
        return
    [(root, server_round)] = rounds
    pids = [c.partition_id for c in ctxs]
    for stream in learner.seed_streams():
        prime_seeds(root, stream, server_round, last=pids)


def _mask_rows(masks: torch.Tensor) -> torch.Tensor:
    """``[steps, n]`` batch masks as ``[steps, width]`` rows of example indices (in order), -1 = padding."""
    counts = masks.sum(1)
    width = max(1, int(counts.max()))
    order = torch.argsort((~masks).to(torch.int8), dim=1, stable=True)[:, :width]
    return torch.where(torch.arange(width) < counts.view(-1, 1), order, -1)


def _plain_copy(arrays: StateDict, slots: Tensors) -> bool:
    """Whether a strict ``load_state_dict(arrays)`` is just a copy of every key into ``slots``."""
    return arrays.keys() == slots.keys() and all(arrays[k].shape == s.shape[1:] for k, s in slots.items())


@torch.no_grad()
def _fill(learner: SupervisedLearner, c: _Client, i: int, stacked: Tensors, anchor: Tensors) -> dict[str, float]:
    """Write client ``i``'s model as ``SupervisedLearner.train`` has it before its first step into
    ``stacked[k][i]`` (and w_global, taken before the transforms, into ``anchor[n][i]``); returns
    the transform metrics.  Without transforms loading is a copy, so the model is not touched."""
    if not c.ctx.config.get(TRANSFORM_KEY) and _plain_copy(c.arrays, stacked):
        source, transformed = c.arrays, {}
    else:
        model = learner._load(c.arrays)
        learner._set_trainable(model, c.ctx)
        for n, p in model.named_parameters():
            if n in anchor:
                anchor[n][i].copy_(p.detach())
        transformed = apply_transforms(model, c.ctx.config)
        source = model.state_dict()
    for k, s in stacked.items():
        s[i].copy_(source[k])
        if k in anchor and source is c.arrays:
            anchor[k][i].copy_(source[k])
    return transformed


# -- the batched step -----------------------------------------------------------------------------

def _loss_fn(model: nn.Module, proximal: bool) -> Callable[..., torch.Tensor]:
    """One client's objective as a function of its parameters (vmapped over clients)."""

    def loss(params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
             anchor: Tensors, mu: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, {**params, **consts}, (x,))
        ce = nn.functional.cross_entropy(logits, y, reduction="none")
        value = (ce * mask).sum() / mask.sum().clamp_min(1)
        if proximal:
            value = value + (mu / 2) * sum(((params[n] - anchor[n]) ** 2).sum() for n in params)
        return value

    return loss


def _example_loss_fn(model: nn.Module) -> Callable[..., torch.Tensor]:
    """One example's cross-entropy as a function of its client's parameters (vmapped over the
    examples of a batch, then over clients): DP-SGD's per-sample gradients."""

    def loss(params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, {**params, **consts}, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, y.unsqueeze(0))

    return loss


def _clip(grads: Tensors, max_norm: float) -> Tensors:
    """``clip_grad_norm_`` per client: scale each client's gradients to global norm <= max_norm."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), 2, dim=1) for g in grads.values()])
    total = torch.linalg.vector_norm(norms, 2, dim=0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {n: g * coef.view(-1, *[1] * (g.dim() - 1)) for n, g in grads.items()}


class _Optimiser:
    """The learner's own optimiser (:func:`clients.supervised.optimizer_for`) stepping the stacked
    ``[C, ...]`` parameters: SGD's and Adam's updates are element-wise, so one ``step()`` is every
    client's own step.  Clients that have finished (a suffix of the chunk) must not move: their
    parameter and state slices are put back after the step."""

    def __init__(self, cfg: ExperimentConfig, params: Tensors) -> None:
        self.params = list(params.values())
        self.opt = optimizer_for(self.params, cfg)

    def step(self, grads: Tensors, k: int) -> None:
        """One step for the first ``k`` clients, with their ``grads`` (``[k, ...]``)."""
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p, g in zip(self.params, grads.values(), strict=True):
            if k == len(p):  # every client of the chunk still trains: the common case
                p.grad = g
                continue
            p.grad = torch.cat([g, g.new_zeros((len(p) - k, *g.shape[1:]))])
            tensors = [p, *(t for t in self.opt.state.get(p, {}).values() if t.dim() > 0)]
            kept += [(t, t[k:].clone()) for t in tensors]
        self.opt.step()
        for t, rest in kept:
            t[k:] = rest


@dataclass
class _Chunk:
    """A chunk's stacked tensors; clients sorted by decreasing number of steps."""

    params: Tensors  # trainable parameters, [C, ...]
    consts: Tensors  # frozen parameters and buffers, [C, ...]
    anchor: Tensors  # w_global of the trainable parameters (empty without any proximal term)
    mu: torch.Tensor  # [C]
    transformed: list[dict[str, float]]
    x: torch.Tensor  # the chunk's examples, concatenated
    y: torch.Tensor
    index: torch.Tensor  # [S, C, B] rows of x (0 where padded)
    mask: torch.Tensor  # [S, C, B] 1.0 for real examples
    active: list[int]  # clients still training at each step (a prefix of the chunk)
    keys: list[str]  # the model's state_dict keys, in order


def _schedule(clients: list[_Client]) -> tuple[torch.Tensor, torch.Tensor]:
    """All steps' batch rows of the concatenated data, [S, C, B], and whether each is real."""
    steps, width = clients[0].steps, max(c.batches.shape[1] for c in clients)
    local = torch.full((len(clients), steps, width), -1, dtype=torch.long)
    for i, c in enumerate(clients):
        local[i, : c.steps, : c.batches.shape[1]] = c.batches
    offsets = torch.tensor([0] + [len(c.y) for c in clients]).cumsum(0)[:-1].view(-1, 1, 1)
    real = local >= 0
    index = torch.where(real, local + offsets, 0)
    return index.transpose(0, 1).contiguous(), real.transpose(0, 1).contiguous()


def _stack_chunk(learner: SupervisedLearner, clients: list[_Client]) -> _Chunk:
    model = learner.model
    stacked = {k: torch.empty((len(clients), *v.shape), dtype=v.dtype, device=v.device)
               for k, v in model.state_dict().items()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    proximal = any(PROXIMAL_MU in c.ctx.config for c in clients)
    anchor = {n: torch.empty_like(stacked[n]) for n in trainable} if proximal else {}
    transformed = [_fill(learner, c, i, stacked, anchor) for i, c in enumerate(clients)]
    params = {n: stacked[n] for n in trainable}
    consts = {k: v for k, v in stacked.items() if k not in params}
    index, real = _schedule(clients)
    dtype = next(iter(params.values())).dtype
    active = [sum(c.steps > s for c in clients) for s in range(clients[0].steps)]
    device = next(iter(params.values())).device
    mu = torch.tensor([c.mu for c in clients], dtype=dtype, device=device)
    return _Chunk(params, consts, anchor, mu, transformed, torch.cat([c.x for c in clients]),
                  torch.cat([c.y for c in clients]), index.to(device), real.to(device, dtype), active, list(stacked))


def _train_chunk(learner: SupervisedLearner, clients: list[_Client]) -> list[TrainResult]:
    """Train clients (sorted by decreasing steps) together; their results in the same order."""
    model = learner.model
    model.train()
    ch = _stack_chunk(learner, clients)
    opt = _Optimiser(learner.cfg, ch.params)
    private = clients[0].dp is not None
    step = _private_step(learner, ch, clients) if private else _plain_step(learner, ch)
    losses = ch.mu.new_zeros((len(ch.active), len(clients)), dtype=torch.float64)
    for s, k in enumerate(ch.active):
        grads, loss = step(s, k)
        opt.step(grads, k)
        losses[s, :k] = loss.detach().double()
    losses = losses.cpu()
    stacked = {**ch.params, **ch.consts}
    host = {k: to_host(stacked[k]) for k in ch.keys}  # one host copy per key; each client's arrays are its rows
    results = []
    for i, c in enumerate(clients):
        arrays = {k: host[k][i] for k in ch.keys}
        if c.dp is None:
            mean_loss, extra = float(losses[: c.steps, i].sum()) / c.steps, {}
        else:  # Opacus' mean over the examples seen (0 if every batch was empty)
            mean_loss = float(losses[: c.steps, i].sum()) / max(int((c.batches >= 0).sum()), 1)
            extra = learner.dp.end_round(c.ctx, c.dp.plan, c.steps)
        metrics = {"train_loss": mean_loss, "local_steps": float(c.steps), **ch.transformed[i], **extra}
        results.append(TrainResult(arrays, num_examples=len(c.y), metrics=metrics, owned=True))
    return results


Step = Callable[[int, int], tuple[Tensors, torch.Tensor]]


def _plain_step(learner: SupervisedLearner, ch: _Chunk) -> Step:
    """Step ``s`` of the first ``k`` clients: their (clipped) gradients and mean batch losses."""
    proximal = bool(ch.anchor)
    grad_fn = vmap(grad_and_value(_loss_fn(learner.model, proximal)), randomness="error")
    clip = learner.params.grad_clip

    def step(s: int, k: int) -> tuple[Tensors, torch.Tensor]:
        idx = ch.index[s, :k]
        grads, loss = grad_fn({n: p[:k] for n, p in ch.params.items()}, {n: c[:k] for n, c in ch.consts.items()},
                              ch.x[idx], ch.y[idx], ch.mask[s, :k], {n: a[:k] for n, a in ch.anchor.items()},
                              ch.mu[:k])
        return (grads if clip is None else _clip(grads, clip)), loss

    return step


def _private_step(learner: SupervisedLearner, ch: _Chunk, clients: list[_Client]) -> Step:
    """Step ``s`` of the first ``k`` clients under DP-SGD: Opacus' privatised gradient
    (:func:`privacy.cohort.privatise`, plus DP-FedProx's proximal gradient after the noise) and the
    sum of the batch's per-example losses."""
    grad_fn = vmap(vmap(grad_and_value(_example_loss_fn(learner.model)), in_dims=(None, None, 0, 0)),
                   randomness="error")
    names = list(ch.params)
    rounds = [c.dp for c in clients if c.dp is not None]
    assert len(rounds) == len(clients)
    noise = {n: ch.params[n].new_zeros((len(ch.active), *ch.params[n].shape)) for n in names}  # [S, C, ...]
    for i, (c, dp) in enumerate(zip(clients, rounds)):
        for n, draws in zip(names, dp.noise, strict=True):
            noise[n][: c.steps, i] = draws
    batch_size = torch.tensor([dp.batch_size for dp in rounds], device=ch.mu.device)
    max_norm = learner.cfg.privacy.max_grad_norm

    def step(s: int, k: int) -> tuple[Tensors, torch.Tensor]:
        idx, mask = ch.index[s, :k], ch.mask[s, :k]
        params = {n: p[:k] for n, p in ch.params.items()}
        per_sample, losses = grad_fn(params, {n: c[:k] for n, c in ch.consts.items()}, ch.x[idx], ch.y[idx])
        grads = privatise(per_sample, mask, max_norm, {n: noise[n][s, :k] for n in names}, batch_size[:k])
        for n, a in ch.anchor.items():
            mu = ch.mu[:k].view(-1, *[1] * (a.dim() - 1))
            grads[n] = grads[n] + mu * (params[n] - a[:k])
        return grads, (losses * mask).sum(1)

    return step


# -- public entry point ---------------------------------------------------------------------------

#: DP cohorts hold every example's gradient of a chunk at once (``[clients, batch, parameters]``); a
#: chunk is cut so that this many elements (16 MiB of float32) fit at the expected batch width
#: (``bench_vectorise.py --dp``: a 101k-parameter MLP ties sequential DP at 2**22, loses 0.78x at 2**24).
DP_CHUNK_ELEMENTS = 1 << 22


def private_chunk(learner: SupervisedLearner, largest: int) -> int:
    """The most clients a DP chunk holds: :data:`DP_CHUNK_ELEMENTS` over (parameters x expected batch)."""
    params = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    return max(1, DP_CHUNK_ELEMENTS // (params * min(largest, learner.cfg.client.batch_size)))


def train_cohort(learner: SupervisedLearner, arrays_list: list[StateDict], ctxs: list[NodeContext],
                 chunk: int) -> list[TrainResult]:
    """``[learner.train(a, c) for a, c in zip(arrays_list, ctxs)]``, computed in vmapped chunks of at
    most ``chunk`` clients; raises ValueError where :func:`vectorise_unsupported` gives a reason."""
    if len(arrays_list) != len(ctxs):
        raise ValueError(f"{len(arrays_list)} arrays for {len(ctxs)} clients")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    reason = vectorise_unsupported(learner, ctxs)
    if reason is not None:
        raise ValueError(f"cannot vectorise this cohort: {reason}")
    if not ctxs:
        return []
    _prime_round_seeds(learner, ctxs)
    sizes = [len(learner.data.client_train(c.partition_id, c.server_round).y) for c in ctxs]
    order = sorted(range(len(ctxs)), key=lambda i: -num_local_steps(sizes[i], learner.cfg))
    if learner.sample_level_dp:
        chunk = min(chunk, private_chunk(learner, max(sizes)))
    results: list[TrainResult | None] = [None] * len(ctxs)
    for start in range(0, len(order), chunk):
        members = order[start : start + chunk]
        clients = [_plan(learner, arrays_list[i], ctxs[i]) for i in members]
        for i, res in zip(members, _train_chunk(learner, clients), strict=True):
            results[i] = res
    done = [r for r in results if r is not None]
    # leave the learner as sequential training would: the last client's model and seeded global RNG
    learner.model.load_state_dict(done[-1].arrays)
    seed_torch(ctxs[-1].seed("torch"))
    return done
